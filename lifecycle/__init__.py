"""Operations that cross the domain apps, above them all: a sandbox's create, kill,
pause / resume and TTLs (``sandboxes``), snapshot, fork and snapshot delete
(``snapshots``), template builds (``templates``), what a ``templateID`` names
(``resolve``, ``sources``), the TTL sweeper (``expiry``) and a dead node's sandboxes
(``lost``). The domain apps below hold the rows, their state tables and their writers;
these modules decide what happens, place work on nodes and record the outcome."""

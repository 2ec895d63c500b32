"""Local services the tests and the benchmarks start and share: the whole stack
(``stack``: API, data plane, node worker on this machine), a second node, a moto S3
server, an OCI registry with test images, and the "networld" namespaces standing in
for the internet. Its own package so both ``tests`` and ``bench`` use it without either
importing the other."""

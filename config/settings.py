"""aenv settings. Every knob comes from an environment variable; the defaults run
one node on this machine with no configuration (SQLite under AENV_HOME, Redis on
127.0.0.1:6379)."""
import os
import re
import socket
from pathlib import Path

import dj_database_url
from django.core.exceptions import ImproperlyConfigured

from config import log_redaction
from config.node_database import database_url as node_database_url
from config.secret_key import load_secret_key
from vmm.net.conntrack import DEFAULT_MAX_FLOWS, DEFAULT_NEW_BURST, DEFAULT_NEW_RATE
from vmm.net.dns import DNSLimits
from vmm.net.spec import DEFAULT_WARM_SLOTS

BASE_DIR = Path(__file__).resolve().parent.parent


def _env(name: str, default: str) -> str:
    value = os.environ.get(name)
    return value if value not in (None, "") else default


def _env_int(name: str, default: int) -> int:
    return int(_env(name, str(default)))


def _env_bool(name: str, default: bool) -> bool:
    """A flag; a value that is neither yes nor no is refused (a misspelt security switch
    must not read as off)."""
    value = _env(name, "1" if default else "0").lower()
    if value not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
        raise ImproperlyConfigured(f"{name}={value!r}: expected 1/0, true/false, yes/no or on/off")
    return value in ("1", "true", "yes", "on")


AENV_HOME = Path(_env("AENV_HOME", str(BASE_DIR / "var"))).resolve()
AENV_HOME.mkdir(parents=True, exist_ok=True)
# Guest images are expensive to build; tests point many AENV_HOMEs at one cache.
AENV_IMAGES_DIR = Path(_env("AENV_IMAGES_DIR", str(AENV_HOME / "images"))).resolve()
# Packages the host downloads for guests (the code-interpreter-v1 template's wheels): per
# checkout, shared by every AENV_HOME, so test stacks do not download again.
AENV_PACKAGE_CACHE = Path(_env("AENV_PACKAGE_CACHE", str(BASE_DIR / ".cache" / "packages"))).resolve()
AENV_NODE_ID = _env("AENV_NODE_ID", socket.gethostname().split(".")[0].lower() or "node-1")
AENV_NODE_ADDRESS = _env("AENV_NODE_ADDRESS", "127.0.0.1")
AENV_DRIVER = _env("AENV_DRIVER", "qemu")
# Sandbox networks (vmm.net): auto = a netns slot per sandbox where the node can make them
# (root, nft, nsenter), else restricted slirp (no egress) with a warning; netns | slirp force.
AENV_NETWORK = _env("AENV_NETWORK", "auto")
AENV_NET_PREFIX = _env("AENV_NET_PREFIX", "aenv")  # names this instance's netns, veths and nft table
AENV_NET_POOL = _env("AENV_NET_POOL", "10.12.0.0/16")  # a /31 per slot; base + 1 is the node's resolver
AENV_NET_WARM_SLOTS = _env_int("AENV_NET_WARM_SLOTS", DEFAULT_WARM_SLOTS)
# Comma-separated CIDRs guests may never reach (e.g. the LAN) / may reach although private (a mirror).
AENV_NET_DENY_EXTRA = tuple(c.strip() for c in _env("AENV_NET_DENY_EXTRA", "").split(",") if c.strip())
AENV_NET_ALLOW_EXTRA = tuple(c.strip() for c in _env("AENV_NET_ALLOW_EXTRA", "").split(",") if c.strip())
# Comma-separated CIDRs that may open connections into this node's slots besides the node itself:
# the data plane's and the API's (dashboard terminal) addresses when they run on another host or
# namespace (vmm.net.host_table). Guests can never reach them. Empty: only the node.
AENV_NET_INGRESS_FROM = tuple(c.strip() for c in _env("AENV_NET_INGRESS_FROM", "").split(",") if c.strip())
# Per sandbox (vmm.net.conntrack): tracked connections at once, new connections a second and the
# burst above that rate; over them a new connection is refused (TCP reset / ICMP), others go on.
AENV_NET_CT_MAX_PER_SANDBOX = _env_int("AENV_NET_CT_MAX_PER_SANDBOX", DEFAULT_MAX_FLOWS)
AENV_NET_CT_NEW_RATE = _env_int("AENV_NET_CT_NEW_RATE", DEFAULT_NEW_RATE)
AENV_NET_CT_NEW_BURST = _env_int("AENV_NET_CT_NEW_BURST", DEFAULT_NEW_BURST)
# The node's resolver (vmm.net.dns): per sandbox, DNS packets a second to 8.8.8.8:53 and the
# burst above that (more are dropped: the guest's resolver retries) and TCP DNS connections at
# once (more are reset); for the whole node, queries forwarded upstream at once.
AENV_NET_DNS_RATE = _env_int("AENV_NET_DNS_RATE", DNSLimits.rate)
AENV_NET_DNS_BURST = _env_int("AENV_NET_DNS_BURST", DNSLimits.burst)
AENV_NET_DNS_TCP_CONNECTIONS = _env_int("AENV_NET_DNS_TCP_CONNECTIONS", DNSLimits.tcp)
AENV_NET_DNS_FORWARD_MAX = _env_int("AENV_NET_DNS_FORWARD_MAX", DNSLimits.forward_max)
AENV_SANDBOX_DOMAIN = _env("AENV_SANDBOX_DOMAIN", "localhost")
# Signed file URLs (E2B's download_url / upload_url; dataplane.access.SignedFile):
# refuse those without signature_expiration (off: E2B's SDK signs without one unless asked),
# and those expiring more than this many seconds ahead (0: any). The data plane enforces both.
AENV_SIGNED_URL_REQUIRE_EXPIRATION = _env_bool("AENV_SIGNED_URL_REQUIRE_EXPIRATION", False)
AENV_SIGNED_URL_MAX_TTL = _env_int("AENV_SIGNED_URL_MAX_TTL", 0)
# Hashes a second the data plane may spend finding which sandbox signed a URL naming none
# (one per secured sandbox per unknown signature; dataplane.signers); past it: 429.
AENV_SIGNED_URL_SCAN_RATE = _env_int("AENV_SIGNED_URL_SCAN_RATE", 20000)
if AENV_SIGNED_URL_MAX_TTL < 0 or AENV_SIGNED_URL_SCAN_RATE < 1:
    raise ImproperlyConfigured("AENV_SIGNED_URL_MAX_TTL must be >= 0 and AENV_SIGNED_URL_SCAN_RATE >= 1")
AENV_DEFAULT_TIMEOUT = _env_int("AENV_DEFAULT_TIMEOUT", 300)
AENV_MAX_TIMEOUT = _env_int("AENV_MAX_TIMEOUT", 24 * 3600)
# A cold boot under TCG takes ~10 s alone and much longer when many boot at once on
# few cores; past this the driver kills the VM and retries once.
AENV_BOOT_TIMEOUT = _env_int("AENV_BOOT_TIMEOUT", 150)
# How long an API call waits for a node to finish a VM operation (a boot may retry once).
AENV_NODE_TASK_DEADLINE = _env_int("AENV_NODE_TASK_DEADLINE", 2 * AENV_BOOT_TIMEOUT + 30)
# A node whose last heartbeat is older than this is considered dead.
AENV_NODE_HEARTBEAT_TIMEOUT = _env_int("AENV_NODE_HEARTBEAT_TIMEOUT", 30)
# A node silent this long is dead: its running sandboxes are declared lost (lifecycle.lost).
# Longer than a node worker's restart, which settles its own sandboxes.
AENV_NODE_LOST_AFTER = _env_int("AENV_NODE_LOST_AFTER", 120)
AENV_NODE_HEARTBEAT_INTERVAL = _env_int("AENV_NODE_HEARTBEAT_INTERVAL", 5)
# How many recent host samples (one per heartbeat) a node keeps for the dashboard's chart.
AENV_NODE_HOST_HISTORY = _env_int("AENV_NODE_HOST_HISTORY", 120)
# The node worker's Prometheus /metrics, on AENV_NODE_ADDRESS with AENV_METRICS_TOKEN, else on
# 127.0.0.1 only (0: none).
AENV_NODE_METRICS_PORT = _env_int("AENV_NODE_METRICS_PORT", 9464)
# Every Prometheus /metrics (the API's, the data plane's, each node's) answers only requests
# with "Authorization: Bearer <this>" when it is set (401 otherwise). Read per request.
AENV_METRICS_TOKEN = _env("AENV_METRICS_TOKEN", "")
if AENV_METRICS_TOKEN and len(AENV_METRICS_TOKEN) < 32:
    raise ImproperlyConfigured("AENV_METRICS_TOKEN must be at least 32 characters (openssl rand -hex 32)")
# Sandbox metrics (E2B's GET /sandboxes/{id}/metrics): each node asks every running
# sandbox's envd for its CPU, memory and disk this often (s), and samples are kept this long (s).
AENV_SANDBOX_METRICS_INTERVAL = float(_env("AENV_SANDBOX_METRICS_INTERVAL", "5"))
# An idle sandbox (its last sample under 5 % CPU and its VM under 3 % of a host core) is asked
# only this often (s; agent.metrics): each request is emulated work in the guest. Up to 30 keeps
# envd's CPU % the average since the previous sample; at most the interval: every round.
AENV_SANDBOX_METRICS_IDLE_INTERVAL = float(_env("AENV_SANDBOX_METRICS_IDLE_INTERVAL", "25"))
if AENV_SANDBOX_METRICS_INTERVAL <= 0 or AENV_SANDBOX_METRICS_IDLE_INTERVAL <= 0:
    raise ImproperlyConfigured("AENV_SANDBOX_METRICS_INTERVAL and AENV_SANDBOX_METRICS_IDLE_INTERVAL must be > 0")
AENV_SANDBOX_METRICS_RETENTION = _env_int("AENV_SANDBOX_METRICS_RETENTION", 6 * 3600)
# Sandbox logs (E2B's GET /sandboxes/{id}/logs): each node reads its running sandboxes' guest
# consoles this often (s) (and once more before a pause or kill); lines are kept this long (s),
# and at most this many per sandbox (the newest).
AENV_SANDBOX_LOGS_INTERVAL = float(_env("AENV_SANDBOX_LOGS_INTERVAL", "2"))
AENV_SANDBOX_LOGS_RETENTION = _env_int("AENV_SANDBOX_LOGS_RETENTION", 7 * 24 * 3600)
AENV_SANDBOX_LOG_MAX_LINES = _env_int("AENV_SANDBOX_LOG_MAX_LINES", 10000)
# Lifecycle events (E2B's GET /events/sandboxes) and webhooks (/events/webhooks), package
# events: events are served and kept this many days (the lifecycle sweeper deletes older ones,
# with their webhook deliveries); 0 keeps them forever.
AENV_EVENT_RETENTION_DAYS = _env_int("AENV_EVENT_RETENTION_DAYS", 7)
# Webhook deliveries run on the control plane's Celery queue (manage.py run_events_worker),
# never on a node's: one POST per attempt, this many attempts at most, the n-th retry
# AENV_WEBHOOK_BACKOFF * 2^(n-1) s after the previous failure (at most AENV_WEBHOOK_BACKOFF_MAX),
# each attempt cut off after AENV_WEBHOOK_TIMEOUT s, at most AENV_WEBHOOK_MAX_RESPONSE_BYTES of
# the receiver's answer read.
AENV_WEBHOOK_QUEUE = _env("AENV_WEBHOOK_QUEUE", "control.events")
AENV_WEBHOOK_MAX_ATTEMPTS = _env_int("AENV_WEBHOOK_MAX_ATTEMPTS", 6)
AENV_WEBHOOK_BACKOFF = float(_env("AENV_WEBHOOK_BACKOFF", "2"))
AENV_WEBHOOK_BACKOFF_MAX = float(_env("AENV_WEBHOOK_BACKOFF_MAX", "600"))
AENV_WEBHOOK_TIMEOUT = float(_env("AENV_WEBHOOK_TIMEOUT", "10"))
AENV_WEBHOOK_MAX_RESPONSE_BYTES = _env_int("AENV_WEBHOOK_MAX_RESPONSE_BYTES", 65536)
AENV_WEBHOOK_CONCURRENCY = _env_int("AENV_WEBHOOK_CONCURRENCY", 8)
AENV_WEBHOOKS_PER_TEAM = _env_int("AENV_WEBHOOKS_PER_TEAM", 20)
# A webhook URL may name a loopback or private (RFC 1918, ULA, CGNAT) address only when this is
# on (an operator's choice, e.g. receivers inside the same network; the tests' 127.0.0.1
# receiver). Link-local, metadata, multicast and unspecified addresses are refused always.
AENV_WEBHOOK_ALLOW_PRIVATE = _env_bool("AENV_WEBHOOK_ALLOW_PRIVATE", False)
for _name in ("AENV_WEBHOOK_MAX_ATTEMPTS", "AENV_WEBHOOK_MAX_RESPONSE_BYTES", "AENV_WEBHOOK_CONCURRENCY"):
    if globals()[_name] < 1:
        raise ImproperlyConfigured(f"{_name} must be at least 1")
if AENV_WEBHOOK_TIMEOUT <= 0 or AENV_WEBHOOK_BACKOFF < 0 or AENV_EVENT_RETENTION_DAYS < 0:
    raise ImproperlyConfigured("AENV_WEBHOOK_TIMEOUT must be > 0, AENV_WEBHOOK_BACKOFF and "
                               "AENV_EVENT_RETENTION_DAYS >= 0")
# A guest may write its serial console without end: each round the node keeps only the
# newest this many KiB of its console file on disk (the rest becomes a hole; vmm.qemu.console).
AENV_CONSOLE_LOG_MAX_KB = _env_int("AENV_CONSOLE_LOG_MAX_KB", 1024)
# Each guest's root disk I/O, reads and writes together (vmm.qemu.iolimits; 0: unlimited):
# a guest over it is slowed, so one sandbox cannot take the node's disk from the others.
AENV_DISK_BPS_MAX_MB = _env_int("AENV_DISK_BPS_MAX_MB", 200)
AENV_DISK_IOPS_MAX = _env_int("AENV_DISK_IOPS_MAX", 4000)
# Node worker: parallel VM operations, and how far capacity may be overcommitted
# (idle microVMs use little CPU; guest RAM is touched lazily and ballooned back).
AENV_NODE_CONCURRENCY = _env_int("AENV_NODE_CONCURRENCY", 32)
# The node worker's and the API's C heap (vmm.process_heap): at most this many glibc malloc
# arenas (0: glibc's own limit, 8 a core), and their free pages given back every this many
# seconds (0: never).
AENV_MALLOC_ARENAS = _env_int("AENV_MALLOC_ARENAS", 2)
AENV_MALLOC_TRIM_INTERVAL = float(_env("AENV_MALLOC_TRIM_INTERVAL", "60"))
# A node worker told to stop (SIGTERM) first pauses its running sandboxes to disk, for at
# most this long (agent.shutdown); AENV_NODE_STOP_PAUSE=0 leaves them running instead.
AENV_NODE_STOP_PAUSE = _env_bool("AENV_NODE_STOP_PAUSE", True)
AENV_NODE_STOP_TIMEOUT = _env_int("AENV_NODE_STOP_TIMEOUT", 300)
# With the S3 store, a sandbox paused this long (s) is exported there so another node can
# resume it if its own is gone (agent.moves); a stopping node exports its paused ones at once.
AENV_PAUSE_EXPORT_DELAY = float(_env("AENV_PAUSE_EXPORT_DELAY", "30"))
# vCPUs placement may reserve per host core. From what sandboxes cost: an idle TCG guest here
# takes ~2.6 % of a core (bench), so 64 vCPUs a core (32 default 2-vCPU sandboxes) keep a
# node of idle sandboxes at ~83 % of its CPU; busy guests share the cores like any overcommit.
AENV_NODE_VCPU_OVERCOMMIT = float(_env("AENV_NODE_VCPU_OVERCOMMIT", "64"))
AENV_NODE_MEMORY_OVERCOMMIT = float(_env("AENV_NODE_MEMORY_OVERCOMMIT", "1.5"))
# What placement reserves for a fork child while it shares its parent's memory copy-on-write
# (from the fork until its first pause; a resumed child reserves its whole shape again):
# memory, MiB (never more than its shape), from the measured host memory of a forked child
# (fork x16 of 2 vCPU / 512 MiB under TCG here: PSS 63-67 MiB, anonymous 60-63 MiB, mostly
# QEMU's own; the lifecycle bench's 1 vCPU / 256 MiB children: 85-93 MiB) plus room for what a
# rollout writes; and its vCPUs divided by this overcommit, rounded up (1: an idle child took
# 3.3-3.8 % of a core, what any idle guest takes, so children are not cheaper in CPU).
AENV_FORK_CHILD_MEMORY_MB = _env_int("AENV_FORK_CHILD_MEMORY_MB", 128)
AENV_FORK_VCPU_OVERCOMMIT = float(_env("AENV_FORK_VCPU_OVERCOMMIT", "1"))
if AENV_FORK_CHILD_MEMORY_MB < 1 or AENV_FORK_VCPU_OVERCOMMIT < 1:
    raise ImproperlyConfigured("AENV_FORK_CHILD_MEMORY_MB and AENV_FORK_VCPU_OVERCOMMIT must be at least 1")
# Guest RAM lives in tmpfs (/dev/shm) and a guest whose tmpfs fills up dies: a node starts a
# VM only while the tmpfs has its memory plus this much (MiB) free for the running ones.
AENV_SHM_HEADROOM_MB = _env_int("AENV_SHM_HEADROOM_MB", 1024)
# Where that tmpfs is: the RAM files of guests, captures and forks (a tmpfs of its own bounds
# what guests may take of the host's memory; tests fill a small private one).
AENV_SHM_DIR = Path(_env("AENV_SHM_DIR", "/dev/shm"))
# RAM files a node makes ahead, per recently used booted template (its two most recent), so a
# create renames one into place instead of copying the template's memory (0: copy each time).
# They live in the same tmpfs and are freed first when a VM needs the room.
AENV_WARM_RAM_COPIES = _env_int("AENV_WARM_RAM_COPIES", 1)
# Which node that fits gets a new sandbox: "spread" (the least loaded) or "pack" (the most
# loaded: fewer busy nodes, the others free for large sandboxes).
AENV_PLACEMENT = _env("AENV_PLACEMENT", "spread")
if AENV_PLACEMENT not in ("spread", "pack"):
    raise ImproperlyConfigured(f"AENV_PLACEMENT must be spread or pack, not {AENV_PLACEMENT!r}")
AENV_BASE_CPU_COUNT = _env_int("AENV_BASE_CPU_COUNT", 2)
AENV_BASE_MEMORY_MB = _env_int("AENV_BASE_MEMORY_MB", 512)
AENV_BASE_DISK_MB = _env_int("AENV_BASE_DISK_MB", 2048)
# Lifecycle (lifecycle.expiry, run_lifecycle, agent.reconcile):
# how long a pause / resume may take on the node (a TCG pause to disk writes the RAM file),
AENV_LIFECYCLE_DEADLINE = _env_int("AENV_LIFECYCLE_DEADLINE", AENV_NODE_TASK_DEADLINE)
# a snapshot capture (a TCG capture copies the guest RAM) and a fork (capture, `count`
# restores and /inits), how long a kill waits for its node before it is recorded
# unconfirmed, and how long a retried create with the same Idempotency-Key gets the same
# sandbox,
AENV_SNAPSHOT_DEADLINE = _env_int("AENV_SNAPSHOT_DEADLINE", AENV_LIFECYCLE_DEADLINE)
AENV_FORK_DEADLINE = _env_int("AENV_FORK_DEADLINE", AENV_NODE_TASK_DEADLINE)
AENV_KILL_DEADLINE = _env_int("AENV_KILL_DEADLINE", 30)
AENV_IDEMPOTENCY_WINDOW = _env_int("AENV_IDEMPOTENCY_WINDOW", 24 * 3600)
# Seconds an admission refusal (503: no node has room now) tells clients to wait before trying
# again (Retry-After): about one create's time here, when a finished cycle may have freed room.
AENV_ADMISSION_RETRY_AFTER = _env_int("AENV_ADMISSION_RETRY_AFTER", 5)
if AENV_ADMISSION_RETRY_AFTER < 1:
    raise ImproperlyConfigured("AENV_ADMISSION_RETRY_AFTER must be at least 1 (seconds)")
# how long a paused sandbox is kept before it is killed and its files deleted (0: forever),
AENV_PAUSED_RETENTION = _env_int("AENV_PAUSED_RETENTION", 30 * 24 * 3600)
# how often the sweeper looks for expired sandboxes, and how many it handles at once,
AENV_LIFECYCLE_PERIOD = float(_env("AENV_LIFECYCLE_PERIOD", "1.0"))
AENV_LIFECYCLE_CONCURRENCY = _env_int("AENV_LIFECYCLE_CONCURRENCY", 4)
# the minimum TTL a sandbox gets when traffic auto-resumes it,
AENV_AUTO_RESUME_TIMEOUT = _env_int("AENV_AUTO_RESUME_TIMEOUT", 300)
# and after how long a node treats a sandbox stuck in pausing / resuming / killing as
# abandoned (its caller gave up) and reconciles it to what the VM really is.
AENV_RECONCILE_STALE = _env_int("AENV_RECONCILE_STALE", AENV_LIFECYCLE_DEADLINE + 60)
AENV_RECONCILE_INTERVAL = _env_int("AENV_RECONCILE_INTERVAL", 30)
# How often a node looks at its running sandboxes' VMs (agent.vm_watch): a VM whose process
# died or whose disk reads failed (a lazily read snapshot whose store went away) makes its
# sandbox "error" at the next look, not at the next worker start.
AENV_VM_WATCH_INTERVAL = float(_env("AENV_VM_WATCH_INTERVAL", "5"))
# Snapshot store (agent.stores): "posix_fs" keeps snapshot files on the node that
# took them; "s3" also uploads them (chunked, content-addressed) to a bucket, so any node
# can restore them, downloading into a bounded cache under AENV_HOME/cache/snapshots.
# The most children of one fork that one node starts. Without the S3 store (all on the
# parent's node) also the most one fork may ask for; with it the rest go to other nodes
# (lifecycle.snapshots.fork_spread). The API and the dashboard share it.
AENV_FORK_MAX_PER_NODE = _env_int("AENV_FORK_MAX_PER_NODE", 32)
AENV_SNAPSHOT_BACKEND = _env("AENV_SNAPSHOT_BACKEND", "posix_fs")
AENV_S3_ENDPOINT = _env("AENV_S3_ENDPOINT", "")  # empty: AWS's own endpoint for the region
AENV_S3_BUCKET = _env("AENV_S3_BUCKET", "")
AENV_S3_REGION = _env("AENV_S3_REGION", "")
AENV_S3_PREFIX = _env("AENV_S3_PREFIX", "")  # key prefix, e.g. one per deployment sharing a bucket
AENV_S3_CONCURRENCY = _env_int("AENV_S3_CONCURRENCY", 8)  # parallel chunk transfers
# Chunks uploaded zstd-compressed when that saves a tenth ("zstd") or as they are ("off");
# readers decompress what is marked either way (chunkfs.compression).
AENV_S3_CHUNK_COMPRESSION = _env("AENV_S3_CHUNK_COMPRESSION", "zstd")
AENV_SNAPSHOT_CACHE_MB = _env_int("AENV_SNAPSHOT_CACHE_MB", 20 * 1024)
# The node's chunk cache (chunkfs.cache, under AENV_HOME/cache/chunks): the chunks of images and
# snapshots that lazily filled files read, kept hot/cold (2Q) and never above this bound.
AENV_CHUNK_CACHE_MB = _env_int("AENV_CHUNK_CACHE_MB", 20 * 1024)
# Lazy restores (agent.stores.lazy): a node restores an S3 snapshot it lacks from lazily filled
# files (its chunkfs daemon) instead of downloading it whole. "auto": on where FUSE works
# (/dev/fuse and fusermount3), "1"/"0": on/off.
AENV_LAZY_RESTORE = _env("AENV_LAZY_RESTORE", "auto")
# Peer fetch (agent.chunk_peers): the node's chunkfs daemon serves its chunk cache to the other
# nodes on AENV_NODE_ADDRESS:AENV_CHUNK_PEER_PORT (bearer token derived from DJANGO_SECRET_KEY)
# and asks them for a chunk before the store. Needs lazy restores; off by default.
AENV_CHUNK_PEER_FETCH = _env_bool("AENV_CHUNK_PEER_FETCH", False)
AENV_CHUNK_PEER_PORT = _env_int("AENV_CHUNK_PEER_PORT", 9465)
# A fork across nodes hands its capture to the other nodes before its upload ends (its manifest
# pending in the store, its chunks from the parent's node by peer fetch): their children start
# beside the upload. Takes effect only where every node involved has peer fetch; "0": off.
AENV_FORK_HANDOFF = _env_bool("AENV_FORK_HANDOFF", True)
# How long a read of a lazily filled file waits for a chunk the store does not deliver before
# it fails with EIO (the chunkfs daemon's --read-deadline): the guest's disk read fails, never hangs.
AENV_CHUNK_READ_DEADLINE = float(_env("AENV_CHUNK_READ_DEADLINE", "30"))
# The largest request body the API and the dashboard take, chunked or with a length
# (config.request_body answers 413 past it); Django's own form limit follows it.
AENV_API_MAX_BODY_BYTES = _env_int("AENV_API_MAX_BODY_BYTES", 2621440)
DATA_UPLOAD_MAX_MEMORY_SIZE = AENV_API_MAX_BODY_BYTES
# Seconds the API (daphne) keeps an idle kept-alive connection open: longer than the E2B SDKs
# keep pooled ones (300 s), so the client closes first (config.daphne_idle).
AENV_API_IDLE_TIMEOUT = float(_env("AENV_API_IDLE_TIMEOUT", "330"))
if not 1 <= AENV_API_IDLE_TIMEOUT <= 86400:
    raise ImproperlyConfigured("AENV_API_IDLE_TIMEOUT must be between 1 and 86400 seconds")
# How long an API process keeps a live API key it has looked up (sandboxes.key_cache): a key
# revoked elsewhere (another API process) is refused here within this many seconds; the process
# that revokes it refuses it at once. 0: every request reads the key from the database.
AENV_API_KEY_CACHE_SECONDS = float(_env("AENV_API_KEY_CACHE_SECONDS", "2"))
if AENV_API_KEY_CACHE_SECONDS < 0 or AENV_API_KEY_CACHE_SECONDS > 60:
    raise ImproperlyConfigured("AENV_API_KEY_CACHE_SECONDS must be between 0 and 60")
# The operators' credential for GET /nodes in full (E2B's X-Admin-Token; api.auth): every
# node's address, metrics port, host figures and every team's load. Empty: none accepted, and
# a team's key sees only node ids, statuses and its own sandboxes' counts. 32 characters at least.
AENV_ADMIN_TOKEN = os.environ.get("AENV_ADMIN_TOKEN", "").strip()
if AENV_ADMIN_TOKEN and len(AENV_ADMIN_TOKEN) < 32:
    raise ImproperlyConfigured("AENV_ADMIN_TOKEN must be at least 32 characters (or empty: no operator token)")
# Joining (nodes.join): a node given AENV_CONTROL_PLANE_URL (the API's base URL) joins there
# with the one-time AENV_NODE_JOIN_TOKEN on its first start and keeps the credential it gets in
# AENV_HOME/node_credential. AENV_NODE_JOIN_REQUIRED (default: on when AENV_CONTROL_PLANE_URL is
# set, i.e. the node is not the single-machine default sharing this machine's control plane):
# on a node, it does not start without having joined; on the control plane, placement and
# nodes.client leave nodes that never joined alone. Join tokens live AENV_NODE_JOIN_TOKEN_TTL s.
AENV_CONTROL_PLANE_URL = _env("AENV_CONTROL_PLANE_URL", "").rstrip("/")
AENV_NODE_JOIN_TOKEN = os.environ.get("AENV_NODE_JOIN_TOKEN", "").strip()
AENV_NODE_JOIN_REQUIRED = _env_bool("AENV_NODE_JOIN_REQUIRED", bool(AENV_CONTROL_PLANE_URL))
AENV_NODE_JOIN_TOKEN_TTL = _env_int("AENV_NODE_JOIN_TOKEN_TTL", 24 * 3600)
# Kubernetes joins (nodes.join.kubernetes_identity): a DaemonSet pod presents its projected
# service-account token (audience AENV_NODE_JOIN_KUBERNETES_AUDIENCE) instead of a join token;
# the control plane checks it with the cluster's TokenReview API (nodes.token_review) as
# AENV_KUBERNETES_API_URL (empty: in-cluster, from KUBERNETES_SERVICE_HOST/PORT) with its own
# service-account token and CA (the standard files) and admits it as node <its pod's node name>
# when it is AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT ("namespace:name"). Off by default.
# On the node, AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE is that projected token (read at each join).
AENV_NODE_JOIN_KUBERNETES = _env_bool("AENV_NODE_JOIN_KUBERNETES", False)
AENV_NODE_JOIN_KUBERNETES_AUDIENCE = _env("AENV_NODE_JOIN_KUBERNETES_AUDIENCE", "aenv-join")
AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT = _env("AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT", "aenv:aenv-node")
if AENV_NODE_JOIN_KUBERNETES and not re.fullmatch(r"[a-z0-9][a-z0-9.-]*:[a-z0-9][a-z0-9.-]*",
                                                  AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT):
    raise ImproperlyConfigured("AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT: namespace:name of the nodes' "
                               f"service account, not {AENV_NODE_JOIN_KUBERNETES_SERVICE_ACCOUNT!r}")
AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE = _env("AENV_NODE_JOIN_KUBERNETES_TOKEN_FILE", "")
AENV_KUBERNETES_API_URL = _env("AENV_KUBERNETES_API_URL", "").rstrip("/")
AENV_KUBERNETES_TOKEN_FILE = _env("AENV_KUBERNETES_TOKEN_FILE", "/var/run/secrets/kubernetes.io/serviceaccount/token")
AENV_KUBERNETES_CA_FILE = _env("AENV_KUBERNETES_CA_FILE", "/var/run/secrets/kubernetes.io/serviceaccount/ca.crt")
AENV_KUBERNETES_TIMEOUT = _env_int("AENV_KUBERNETES_TIMEOUT", 10)
# Per-node PostgreSQL roles (nodes.db_roles): on the control plane, each node that joins gets
# a role of its own with only the node worker's tables, cut off at its revocation (the
# database user needs CREATEROLE). On a node of a cluster, the role's URL from the join is
# kept in AENV_NODE_DATABASE_URL_FILE and used for DATABASES (config.node_database).
AENV_NODE_DATABASE_ROLES = _env_bool("AENV_NODE_DATABASE_ROLES", False)
AENV_NODE_DATABASE_URL_FILE = Path(_env("AENV_NODE_DATABASE_URL_FILE", str(AENV_HOME / "node_database_url")))
# Team secrets (team_secrets): values sealed with AES-256-GCM under AENV_SECRETS_KEY (32 bytes,
# hex or base64) or else the key in AENV_SECRETS_KEY_FILE (made owner-only on first use); only
# the API processes need it, never a node. A node's egress proxy asks the API for a value
# (POST /nodes/secrets/resolve, at AENV_CONTROL_PLANE_URL or else AENV_API_PUBLIC_URL) and
# keeps it in memory for AENV_EGRESS_SECRET_CACHE_TTL s. The node's CA for TLS interception
# (vmm.egress_ca) lives in AENV_EGRESS_CA_DIR, its key owner-only and never sent anywhere.
# AENV_EGRESS_UPSTREAM_CA: a CA bundle (PEM file) that replaces the proxy's own (certifi's) for
# verifying the servers of intercepted HTTPS (hosts with network.rules); unset: the public CAs.
AENV_SECRETS_KEY = os.environ.get("AENV_SECRETS_KEY", "").strip()
if AENV_SECRETS_KEY and not re.fullmatch(r"[0-9a-fA-F]{64}|[A-Za-z0-9+/_-]{43}=?", AENV_SECRETS_KEY):
    raise ImproperlyConfigured("AENV_SECRETS_KEY must be 32 bytes: 64 hex digits (openssl rand -hex 32) or base64")
AENV_SECRETS_KEY_FILE = Path(_env("AENV_SECRETS_KEY_FILE", str(AENV_HOME / "secrets_key")))
AENV_EGRESS_SECRET_CACHE_TTL = _env_int("AENV_EGRESS_SECRET_CACHE_TTL", 60)
AENV_EGRESS_CA_DIR = Path(_env("AENV_EGRESS_CA_DIR", str(AENV_HOME / "egress-ca")))
AENV_EGRESS_UPSTREAM_CA = _env("AENV_EGRESS_UPSTREAM_CA", "") or None
# network.egressProxy (lifecycle.sandboxes.egress_proxy): an upstream proxy a user names must be
# public unless this is on (an operator's proxies in the same network; the tests' namespace
# proxies); the API checks it at create / update and the node's egress proxy again at each dial.
AENV_EGRESS_PROXY_ALLOW_PRIVATE = _env_bool("AENV_EGRESS_PROXY_ALLOW_PRIVATE", False)
AENV_API_PUBLIC_URL = _env("AENV_API_PUBLIC_URL", "http://127.0.0.1:3000")
AENV_SANDBOX_PUBLIC_URL = _env("AENV_SANDBOX_PUBLIC_URL", "http://127.0.0.1:3001")
# Template builds (template_builds): the shape a build may ask for (E2B's checks: CPUs 1 or
# even, memory even and at least 128 MiB, both up to these team limits), the defaults
# when it asks for none, how many builds of a team may run at once (429 past it), and how
# long a build may wait for a node's builder to pick it up, and run, before it fails.
AENV_TEMPLATE_DEFAULT_CPU_COUNT = _env_int("AENV_TEMPLATE_DEFAULT_CPU_COUNT", 2)
AENV_TEMPLATE_DEFAULT_MEMORY_MB = _env_int("AENV_TEMPLATE_DEFAULT_MEMORY_MB", 1024)
AENV_TEMPLATE_MAX_CPU_COUNT = _env_int("AENV_TEMPLATE_MAX_CPU_COUNT", 8)
AENV_TEMPLATE_MAX_MEMORY_MB = _env_int("AENV_TEMPLATE_MAX_MEMORY_MB", 8192)
AENV_TEMPLATE_DISK_MB = _env_int("AENV_TEMPLATE_DISK_MB", 4096)
AENV_TEMPLATE_MAX_DISK_MB = _env_int("AENV_TEMPLATE_MAX_DISK_MB", 65536)
AENV_TEMPLATE_MAX_CONCURRENT_BUILDS = _env_int("AENV_TEMPLATE_MAX_CONCURRENT_BUILDS", 8)
AENV_TEMPLATE_PICKUP_TIMEOUT = _env_int("AENV_TEMPLATE_PICKUP_TIMEOUT", 600)
AENV_TEMPLATE_BUILD_TIMEOUT = _env_int("AENV_TEMPLATE_BUILD_TIMEOUT", 3600)
# What a build's commands print is kept in its log up to this many MiB (a RUN in the
# user's image is a hostile guest's output); the rest is counted, not stored.
AENV_BUILD_LOG_MAX_MB = _env_int("AENV_BUILD_LOG_MAX_MB", 16)
for _name in ("AENV_CONSOLE_LOG_MAX_KB", "AENV_DISK_BPS_MAX_MB", "AENV_DISK_IOPS_MAX", "AENV_BUILD_LOG_MAX_MB"):
    if globals()[_name] < 0:  # a negative bound would fail later, inside a VM start or a build
        raise ImproperlyConfigured(f"{_name} must be >= 0")
# The node's image cache: the template layer cache, the pulled images' root disks and
# their OCI blobs, evicted least recently used first (agent.builder.images) after every
# build and at node start; what VMs or snapshots on the node use always stays.
AENV_IMAGE_CACHE_MB = _env_int("AENV_IMAGE_CACHE_MB", 20 * 1024)
# How long finalize waits for the ready command (E2B: 10 min).
AENV_TEMPLATE_READY_TIMEOUT = _env_int("AENV_TEMPLATE_READY_TIMEOUT", 600)
# Registries a node may pull from over plain HTTP or unverified TLS (host or host:port,
# comma-separated); loopback registries always may, as with Docker.
AENV_INSECURE_REGISTRIES = [r.strip() for r in _env("AENV_INSECURE_REGISTRIES", "").split(",") if r.strip()]
# Registries on private or loopback addresses builds may pull from (host or host:port,
# comma-separated): the node pulls for the user, so any other such registry is refused.
AENV_PRIVATE_REGISTRIES = [r.strip() for r in _env("AENV_PRIVATE_REGISTRIES", "").split(",") if r.strip()]
# COPY archives: the largest upload taken (compressed, and unpacked as its tar headers
# say), and how long an upload URL is valid. Uploads live next to the snapshots
# (AENV_SNAPSHOT_BACKEND: AENV_HOME/template-files, or the S3 bucket).
AENV_TEMPLATE_FILE_MAX_BYTES = _env_int("AENV_TEMPLATE_FILE_MAX_BYTES", 2 << 30)
AENV_TEMPLATE_FILE_MAX_UNPACKED_BYTES = _env_int("AENV_TEMPLATE_FILE_MAX_UNPACKED_BYTES", 8 << 30)
AENV_TEMPLATE_UPLOAD_URL_TTL = _env_int("AENV_TEMPLATE_UPLOAD_URL_TTL", 1800)
# Where upload URLs point; empty: the API address the client used for the link request.
AENV_TEMPLATE_UPLOAD_BASE_URL = _env("AENV_TEMPLATE_UPLOAD_BASE_URL", "")
# Team volumes (volumes, docs/volumes.md): their files live in AENV_VOLUMES_DIR/<team>/<volume>,
# a directory the API hosts and every node reach at the same path (shared storage in a
# cluster). New entries belong to AENV_VOLUME_UID:AENV_VOLUME_GID (the guests' `user`) when
# the server runs as root. The content API writes files of at most AENV_VOLUME_MAX_FILE_BYTES
# and lists at most AENV_VOLUME_MAX_LIST_ENTRIES entries; a sandbox mounts at most
# AENV_VOLUME_MAX_MOUNTS volumes.
AENV_VOLUMES_DIR = Path(_env("AENV_VOLUMES_DIR", str(AENV_HOME / "volumes"))).resolve()
AENV_VOLUME_UID = _env_int("AENV_VOLUME_UID", 1000)
AENV_VOLUME_GID = _env_int("AENV_VOLUME_GID", 1000)
AENV_VOLUME_MAX_FILE_BYTES = _env_int("AENV_VOLUME_MAX_FILE_BYTES", 1 << 30)
AENV_VOLUME_MAX_LIST_ENTRIES = _env_int("AENV_VOLUME_MAX_LIST_ENTRIES", 10000)
AENV_VOLUME_MAX_MOUNTS = _env_int("AENV_VOLUME_MAX_MOUNTS", 8)
# A new volume's size limit in MiB (volumes.image: an ext4 image of that size, sparse, loop-mounted
# at its directory; the API and nodes must run as root); 0: plain directories without a limit
# (a store shared between machines, whose own quotas must bound it). Unset: 10240 where this
# process can make limited volumes (root, a local filesystem), else 0 (volumes.models.default_size_mb),
# so an API run as an unprivileged user or over a shared store keeps working as before limits.
AENV_VOLUME_MAX_MB = int(os.environ["AENV_VOLUME_MAX_MB"]) if os.environ.get("AENV_VOLUME_MAX_MB") else None
if AENV_VOLUME_MAX_MB and AENV_VOLUME_MAX_MB < 4:
    raise ImproperlyConfigured(f"AENV_VOLUME_MAX_MB={AENV_VOLUME_MAX_MB}: 0 (no limit) or at least 4 (MiB)")
# How guests mount volumes: "nfs" (an NFSv3 server in each sandbox's slot, vmm.net.volume_server)
# or "off" (a create with volumeMounts is refused with 400; the volume and content APIs still work).
AENV_VOLUME_TRANSPORT = _env("AENV_VOLUME_TRANSPORT", "nfs")
if AENV_VOLUME_TRANSPORT not in ("nfs", "off"):
    raise ImproperlyConfigured(f"AENV_VOLUME_TRANSPORT={AENV_VOLUME_TRANSPORT!r}: expected nfs or off")

DEBUG = _env_bool("DJANGO_DEBUG", False)
# Generated on first start and kept in AENV_HOME/secret_key (0600); DJANGO_SECRET_KEY wins.
SECRET_KEY = load_secret_key(AENV_HOME, os.environ.get("DJANGO_SECRET_KEY"), DEBUG)
ALLOWED_HOSTS = [h for h in _env("DJANGO_ALLOWED_HOSTS", "*").split(",") if h]

INSTALLED_APPS = [
    "daphne",
    "django.contrib.admin",
    "django.contrib.auth",
    "django.contrib.contenttypes",
    "django.contrib.sessions",
    "django.contrib.messages",
    "django.contrib.staticfiles",
    "rest_framework",
    "adrf",
    "drf_spectacular",
    "channels",
    "nodes",
    "snapshots",
    "sandboxes",
    "volumes",  # team volumes and who mounts them
    "team_secrets",
    "template_builds",
    "events",  # lifecycle events as E2B serves them, webhooks and their deliveries
    "lifecycle",  # no models: its management commands (the sweeper, system templates)
    "api",
    "agent",  # no models: the node process's management command (run_node)
    "dashboard",
]

MIDDLEWARE = [
    # Outermost: counts and times every request by route and status (Prometheus /metrics).
    "config.prometheus.RequestMetricsMiddleware",
    # First: answers the E2B API's CORS preflights before anything else runs (not the dashboard's).
    "api.cors.ApiCorsMiddleware",
    # Django's own, run in the event loop while they have no I/O (config.inline_middleware).
    "config.inline_middleware.Security",
    "config.middleware.AsyncWhiteNoiseMiddleware",
    "config.inline_middleware.Session",
    "config.inline_middleware.Common",
    "config.inline_middleware.Csrf",
    "config.inline_middleware.Authentication",
    "config.inline_middleware.Messages",
    # Browser security headers on every answer of this port (config.security_headers).
    "config.inline_middleware.XFrameOptions",
    "config.security_headers.ContentSecurityPolicyMiddleware",
]
# What browsers are told (config.security_headers): never framed; nosniff; the origin only
# as the referrer of same-origin requests; and the CSP (empty AENV_CONTENT_SECURITY_POLICY: the default).
X_FRAME_OPTIONS = "DENY"
SECURE_CONTENT_TYPE_NOSNIFF = True
SECURE_REFERRER_POLICY = "same-origin"
AENV_CONTENT_SECURITY_POLICY = _env("AENV_CONTENT_SECURITY_POLICY", "; ".join([
    "default-src 'self'", "script-src 'self'", "style-src 'self' 'unsafe-inline'", "img-src 'self' data:",
    "connect-src 'self'", "font-src 'self'", "object-src 'none'", "base-uri 'none'", "form-action 'self'",
    "frame-ancestors 'none'",
]))

ROOT_URLCONF = "config.urls"
LOGIN_URL = "/dashboard/login/"
ASGI_APPLICATION = "config.asgi.application"
APPEND_SLASH = False

TEMPLATES = [
    {
        "BACKEND": "django.template.backends.django.DjangoTemplates",
        "DIRS": [BASE_DIR / "templates"],
        "APP_DIRS": True,
        "OPTIONS": {
            "context_processors": [
                "django.template.context_processors.request",
                "django.contrib.auth.context_processors.auth",
                "django.contrib.messages.context_processors.messages",
            ],
        },
    },
]

DATABASES = {
    "default": dj_database_url.parse(
        node_database_url(_env("DATABASE_URL", f"sqlite:///{AENV_HOME / 'db.sqlite3'}"), AENV_CONTROL_PLANE_URL,
                          AENV_NODE_DATABASE_URL_FILE), conn_max_age=0
    )
}
if DATABASES["default"]["ENGINE"] == "django.db.backends.sqlite3":
    # Several processes (daphne, uvicorn, node worker) share one file: WAL + a
    # generous busy timeout + IMMEDIATE transactions avoid "database is locked".
    DATABASES["default"]["OPTIONS"] = {
        "timeout": 30,
        "transaction_mode": "IMMEDIATE",
        "init_command": "PRAGMA journal_mode=WAL; PRAGMA synchronous=NORMAL;",
    }
elif DATABASES["default"]["ENGINE"] == "django.db.backends.postgresql":
    # Under ASGI every request runs its ORM calls on a thread of its own, so without a
    # pool each request would open (and close) a new PostgreSQL connection. Django's backend
    # with a pool that reconnects at most 1 s apart and checks each connection it hands out
    # (config/postgresql/base.py): after a database restart requests go on at once.
    DATABASES["default"]["ENGINE"] = "config.postgresql"
    DATABASES["default"].setdefault("OPTIONS", {})["pool"] = {
        "min_size": 1, "max_size": _env_int("AENV_DB_POOL_SIZE", 48), "timeout": 30}
DEFAULT_AUTO_FIELD = "django.db.models.BigAutoField"

CELERY_BROKER_URL = _env("CELERY_BROKER_URL", "redis://127.0.0.1:6379/0")
CELERY_RESULT_BACKEND = _env("CELERY_RESULT_BACKEND", "redis://127.0.0.1:6379/1")
CELERY_TASK_SERIALIZER = "json"
CELERY_RESULT_SERIALIZER = "json"
CELERY_ACCEPT_CONTENT = ["json"]  # nodes.signing makes it ["aenv-signed"] (signed only) when signing is on
CELERY_RESULT_ACCEPT_CONTENT = ["json"]
# Signed node tasks (nodes.signing): the control plane signs every task with this key (PEM,
# Ed25519; an RSA key made before still signs; only control-plane processes have it) and
# its certificate; a node given the certificate file (one certificate or several, during a
# key rotation) runs only tasks signed by those keys. Unset: the files ``manage.py
# task_signing_keys`` makes in AENV_TASK_SIGNING_DIR, when they exist (the single-machine
# default); a path that is set must exist.
AENV_TASK_SIGNING_KEY = _env("AENV_TASK_SIGNING_KEY", "")
AENV_TASK_SIGNING_CERT = _env("AENV_TASK_SIGNING_CERT", "")
AENV_TASK_SIGNING_DIR = Path(_env("AENV_TASK_SIGNING_DIR", str(AENV_HOME / "task-signing"))).resolve()
# A node (no key, an RSA certificate) also accepting Celery's ``auth`` content: for an upgrade
# from a control plane that still signs that way only; off, it refuses such messages.
AENV_TASK_SIGNING_ACCEPT_CELERY_AUTH = _env_bool("AENV_TASK_SIGNING_ACCEPT_CELERY_AUTH", False)
CELERY_TASK_ACKS_LATE = False
CELERY_WORKER_PREFETCH_MULTIPLIER = 1
# kombu's Redis transport copies every delivered message into an "unacked" hash and removes it
# at the ack (two Redis round trips before a node task runs) so it can redeliver, an hour
# later, what a worker that died had taken. aenv never wants that: a node's queue is purged at
# its start (agent.reconcile.purge_queue: a pause delivered after the reconcile would undo it),
# tasks expire with their caller's deadline, and a worker's warm shutdown still puts back what
# it had not started (kombu keeps that list in memory). Off: a delivered message is gone.
CELERY_BROKER_TRANSPORT_OPTIONS = {"ack_emulation": False}
CELERY_RESULT_EXPIRES = 3600
CELERY_BROKER_CONNECTION_RETRY_ON_STARTUP = True

CHANNEL_LAYERS = {
    "default": {
        "BACKEND": "channels_redis.core.RedisChannelLayer",
        "CONFIG": {"hosts": [_env("AENV_CHANNEL_LAYER_URL", "redis://127.0.0.1:6379/2")]},
    }
}

REST_FRAMEWORK = {
    "DEFAULT_AUTHENTICATION_CLASSES": ["api.auth.ApiKeyAuthentication"],
    "DEFAULT_PERMISSION_CLASSES": ["rest_framework.permissions.IsAuthenticated"],
    "DEFAULT_RENDERER_CLASSES": ["rest_framework.renderers.JSONRenderer"],
    "DEFAULT_PARSER_CLASSES": ["api.parsers.JSONParser"],  # DRF's, deep nesting a 400
    "EXCEPTION_HANDLER": "api.errors.e2b_exception_handler",
    "DEFAULT_SCHEMA_CLASS": "drf_spectacular.openapi.AutoSchema",
    "UNAUTHENTICATED_USER": None,
}
SPECTACULAR_SETTINGS = {
    "TITLE": "aenv API",
    "DESCRIPTION": "E2B-compatible control plane for aenv microVM sandboxes",
    "VERSION": "0.1.0",
    # One name for E2B's build status wherever it appears (status, buildStatus).
    "ENUM_NAME_OVERRIDES": {"TemplateBuildStatusEnum": "template_builds.models.BuildStatus",
                            "NodeStatusEnum": "nodes.summary.STATUSES"},
    # OpenAPI links (which answer's id feeds which operation): api/schema_links.py.
    "POSTPROCESSING_HOOKS": ["drf_spectacular.hooks.postprocess_schema_enums", "api.schema_links.add_links"],
}

STATIC_URL = "/static/"
STATIC_ROOT = BASE_DIR / "staticfiles"
STATICFILES_DIRS = [BASE_DIR / "static"]
# Third-party browser assets installed by scripts/setup_frontend.sh (npm, never committed):
# only the built files are exposed, under static/vendor/. Absent until that script ran.
_VENDOR = BASE_DIR / "vendor" / "node_modules" / "@xterm"
STATICFILES_DIRS += [
    (prefix, path) for prefix, path in [
        ("vendor/xterm", _VENDOR / "xterm" / "lib"),
        ("vendor/xterm-css", _VENDOR / "xterm" / "css"),
        ("vendor/addon-fit", _VENDOR / "addon-fit" / "lib"),
    ] if path.is_dir()
]

LANGUAGE_CODE = "en-us"
TIME_ZONE = "UTC"
USE_I18N = True
USE_TZ = True

LOGGING = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"plain": {"format": "%(asctime)s %(levelname)s %(name)s: %(message)s"}},
    "handlers": {"console": {"class": "logging.StreamHandler", "formatter": "plain"}},
    "root": {"handlers": ["console"], "level": _env("AENV_LOG_LEVEL", "INFO")},
}
# Every process that loads these settings: no credential reaches a log (signed-URL
# signatures, tokens, API keys; config.log_redaction), whatever handler writes it.
log_redaction.install()

#!/usr/bin/env bash
# Makes this machine an aenv node that joins a cluster (and, with --control-plane, the
# machine that also serves the API, the data plane and the sweeper). Run it as root from a
# checkout of aenv (e.g. in /opt/aenv); running it again with the same flags changes nothing
# but restarts the units (VMs survive a node restart: see aenv-node.service).
#
#   deploy/install-node.sh --database-url postgres://aenv:pw@db:5432/aenv \
#       --broker-url rediss://aenv-node-node-2:PASSWORD@broker:6380/0 --broker-ca /etc/aenv/broker-ca.pem \
#       --node-id node-2 --node-address 10.0.0.12 --store s3 --s3-bucket aenv-snapshots --s3-endpoint http://s3:9000 \
#       --control-plane-url https://api.example:3000 --join-token aenv_join_...   # manage.py node_tokens create
#   deploy/install-node.sh --control-plane            # everything on one machine (SQLite, local Redis)
#
# What it does: the node's packages and the venv (scripts/setup.sh's steps), the settings in
# /etc/aenv/aenv.env (flags win over the environment, which wins over an existing file),
# the guest images (vmm.images + vmm.templates, cached), then the systemd units of
# deploy/systemd/ rendered for this checkout, enabled and started. --dry-run prints all of
# it (the settings file and every unit in full) and changes nothing.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
UNITS_SRC="$ROOT/deploy/systemd"
# The paths the committed units name; rendering replaces them with this install's.
UNIT_PREFIX="/opt/aenv" UNIT_HOME="/var/lib/aenv" UNIT_ENV_FILE="/etc/aenv/aenv.env"

usage() {
  cat <<'USAGE'
usage: deploy/install-node.sh [options]
  --database-url URL     PostgreSQL of the cluster (DATABASE_URL); required unless --control-plane
                         (then SQLite in AENV_HOME, for one machine only)
  --broker-url URL       Celery broker (CELERY_BROKER_URL, default redis://127.0.0.1:6379/0); with
                         Redis the result backend and the channel layer use its databases 1 and 2.
                         A Redis on another host needs its ACL user (deploy/redis/users.acl.template):
                         a node its own, redis://aenv-node-<ID>:PASSWORD@broker:6379/0 (rendered with
                         NODE_IDS; only its queue node.<ID>), or the shared role user aenv-node where
                         per-node users are not rendered (aenv-control for the control plane); over
                         TLS rediss://aenv-node-<ID>:PASSWORD@broker:6380/0?ssl_cert_reqs=required&ssl_ca_certs=/etc/aenv/broker-ca.pem
  --broker-ca PATH       the CA that signed the broker's TLS certificate: a rediss:// broker URL gets
                         ?ssl_cert_reqs=required&ssl_ca_certs=PATH (so do the result and channel URLs)
  --result-url URL       CELERY_RESULT_BACKEND (needed when the broker is not Redis)
  --channel-layer-url URL  AENV_CHANNEL_LAYER_URL (a Redis; needed when the broker is not Redis)
  --node-id ID           AENV_NODE_ID (default: the short host name); queue node.<ID>
  --control-plane-url URL  AENV_CONTROL_PLANE_URL: the API this node joins at (required unless
                         --control-plane)
  --task-cert PATH       AENV_TASK_SIGNING_CERT: the control plane's task-signing certificate (its
                         /etc/aenv/task-signing/cert.pem, copied here); the node runs only tasks signed
                         by its key. Required unless --control-plane (which makes the key pair)
  --join-token TOKEN     AENV_NODE_JOIN_TOKEN: the one-time token the node joins with on its first
                         start (manage.py node_tokens create [--node-id ID], or the dashboard's nodes
                         page); it then keeps its own credential in AENV_HOME/node_credential
  --node-address ADDR    AENV_NODE_ADDRESS: where the control plane reaches this node (required
                         unless --control-plane, where it defaults to 127.0.0.1)
  --net-pool CIDR        AENV_NET_POOL, the sandbox address pool (give every node its own)
  --network auto|netns|slirp  AENV_NETWORK (default auto: a netns slot per sandbox as root); with the
                         data plane on another machine, netns needs --net-ingress-from and a
                         route to this node's pool there, else slirp (see docs/deployment.md)
  --net-ingress-from CIDR[,CIDR]  AENV_NET_INGRESS_FROM: the data plane's / dashboard's addresses,
                         which may open connections into this node's sandboxes (nothing else may)
  --store posix_fs|s3    AENV_SNAPSHOT_BACKEND (s3 for many nodes: any node restores any snapshot)
  --s3-bucket NAME  --s3-endpoint URL  --s3-region NAME  --s3-prefix PREFIX
  --s3-access-key ID  --s3-secret-key KEY   (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY)
  --secret-key KEY       DJANGO_SECRET_KEY, the same on every machine of the cluster (a control
                         plane generates one the first time and keeps it)
  --sandbox-domain NAME  AENV_SANDBOX_DOMAIN (wildcard host names of sandbox ports)
  --api-url URL  --sandbox-url URL   AENV_API_PUBLIC_URL / AENV_SANDBOX_PUBLIC_URL
  --control-plane        also install the API, data plane and sweeper units; migrates the database
  --node-database-roles  with --control-plane on PostgreSQL: AENV_NODE_DATABASE_ROLES=1, each node that
                         joins gets a PostgreSQL role of its own with only the node worker's tables,
                         cut off when it is revoked (the control plane's database user needs CREATEROLE);
                         a node's --database-url then needs no user or password (postgres://db:5432/aenv)
  --home DIR             AENV_HOME (default /var/lib/aenv)
  --env-file PATH        the settings file (default /etc/aenv/aenv.env)
  --systemd-dir DIR      where units go (default /etc/systemd/system)
  --no-images            do not build the guest images (an images dir prepared otherwise)
  --dry-run              print what would be done, the settings file and the units; change nothing
  -h, --help
USAGE
}

die() { echo "install-node: $*" >&2; exit 2; }

# Settings: an existing file, then the environment, then the flags.
declare -A SET=()
read_env_file() {  # $1: a file this script wrote (KEY=value or KEY='value' lines)
  local line key value
  [ -f "$1" ] || return 0
  while IFS= read -r line || [ -n "$line" ]; do
    [[ "$line" =~ ^([A-Z][A-Z0-9_]*)=(.*)$ ]] || continue
    key="${BASH_REMATCH[1]}" value="${BASH_REMATCH[2]}"
    if [[ "$value" =~ ^\'(.*)\'$ ]]; then value="${BASH_REMATCH[1]}"; fi
    SET[$key]="$value"
  done < "$1"
}

ENV_FILE="$UNIT_ENV_FILE" HOME_DIR="" SYSTEMD_DIR="/etc/systemd/system"
REDIS_ACL_FILE="/etc/redis/aenv-users.acl" REDIS_NODE_PASSWORD_FILE="/etc/aenv/redis-node-password"
CONTROL_PLANE=0 DRY_RUN=0 IMAGES=1 BROKER_CA=""
declare -A FLAG=()
# Flags → settings names (the env file holds nothing else).
declare -A FLAG_KEY=(
  [--database-url]=DATABASE_URL [--broker-url]=CELERY_BROKER_URL [--result-url]=CELERY_RESULT_BACKEND
  [--channel-layer-url]=AENV_CHANNEL_LAYER_URL [--node-id]=AENV_NODE_ID [--node-address]=AENV_NODE_ADDRESS
  [--net-pool]=AENV_NET_POOL [--net-ingress-from]=AENV_NET_INGRESS_FROM [--network]=AENV_NETWORK [--store]=AENV_SNAPSHOT_BACKEND [--s3-bucket]=AENV_S3_BUCKET
  [--s3-endpoint]=AENV_S3_ENDPOINT [--s3-region]=AENV_S3_REGION [--s3-prefix]=AENV_S3_PREFIX
  [--s3-access-key]=AWS_ACCESS_KEY_ID [--s3-secret-key]=AWS_SECRET_ACCESS_KEY [--secret-key]=DJANGO_SECRET_KEY
  [--sandbox-domain]=AENV_SANDBOX_DOMAIN [--api-url]=AENV_API_PUBLIC_URL [--sandbox-url]=AENV_SANDBOX_PUBLIC_URL
  [--control-plane-url]=AENV_CONTROL_PLANE_URL [--join-token]=AENV_NODE_JOIN_TOKEN [--task-cert]=AENV_TASK_SIGNING_CERT
)
while [ $# -gt 0 ]; do
  case "$1" in
    -h|--help) usage; exit 0 ;;
    --control-plane) CONTROL_PLANE=1 ;;
    --node-database-roles) FLAG[AENV_NODE_DATABASE_ROLES]=1 ;;
    --dry-run) DRY_RUN=1 ;;
    --no-images) IMAGES=0 ;;
    --home|--env-file|--systemd-dir|--broker-ca)
      [ $# -ge 2 ] || die "$1 needs a value"
      case "$1" in --home) HOME_DIR="$2" ;; --env-file) ENV_FILE="$2" ;; --systemd-dir) SYSTEMD_DIR="$2" ;;
                   --broker-ca) BROKER_CA="$2" ;; esac
      shift ;;
    --*=*) set -- "${1%%=*}" "${1#*=}" "${@:2}"; continue ;;
    *)
      [ -n "${FLAG_KEY[$1]:-}" ] || { usage >&2; die "unknown option $1"; }
      if [ $# -lt 2 ] || [ -z "$2" ]; then die "$1 needs a value"; fi
      FLAG[${FLAG_KEY[$1]}]="$2"; shift ;;
  esac
  shift
done

read_env_file "$ENV_FILE"
for key in "${FLAG_KEY[@]}" AENV_HOME; do
  if [ -n "${!key:-}" ]; then SET[$key]="${!key}"; fi
done
for key in "${!FLAG[@]}"; do SET[$key]="${FLAG[$key]}"; done
[ -z "$HOME_DIR" ] || SET[AENV_HOME]="$HOME_DIR"
: "${SET[AENV_HOME]:=$UNIT_HOME}"
HOME_DIR="${SET[AENV_HOME]}"

# Defaults and checks: a clear word before anything is touched.
: "${SET[AENV_NODE_ID]:=$(hostname -s | tr '[:upper:]' '[:lower:]')}"
[[ "${SET[AENV_NODE_ID]}" =~ ^[a-z0-9][a-z0-9._-]*$ ]] || die "--node-id '${SET[AENV_NODE_ID]}': use lower-case letters, digits, '.', '_' or '-'"
if [ "$CONTROL_PLANE" = 1 ]; then
  : "${SET[AENV_NODE_ADDRESS]:=127.0.0.1}"
else
  [ -n "${SET[DATABASE_URL]:-}" ] || die "a node joining a cluster needs --database-url (the cluster's PostgreSQL); --control-plane alone installs a one-machine aenv on SQLite"
  [ -n "${SET[AENV_NODE_ADDRESS]:-}" ] || die "a node joining a cluster needs --node-address (the address the control plane reaches it at)"
fi
if [ -n "${SET[AENV_NODE_JOIN_TOKEN]:-}" ]; then
  [[ "${SET[AENV_NODE_JOIN_TOKEN]}" =~ ^aenv_join_[0-9a-f]{48}$ ]] || die "--join-token: not a join token (aenv_join_ and 48 hex digits, as manage.py node_tokens create prints it)"
  [ -n "${SET[AENV_CONTROL_PLANE_URL]:-}" ] || die "--join-token needs --control-plane-url (where the node joins)"
fi
if [ -n "${SET[AENV_CONTROL_PLANE_URL]:-}" ] && [[ ! "${SET[AENV_CONTROL_PLANE_URL]}" =~ ^https?://[^/?#]+/?$ ]]; then
  die "--control-plane-url: the API's base URL (https://host:port), not '${SET[AENV_CONTROL_PLANE_URL]}'"
fi
if [ -n "${SET[DATABASE_URL]:-}" ] && [[ ! "${SET[DATABASE_URL]}" =~ ^postgres(ql)?:// ]]; then
  die "--database-url must be a PostgreSQL URL (postgres://user:password@host:5432/db); SQLite is only for one machine (omit it with --control-plane)"
fi
if [ "${SET[AENV_NODE_DATABASE_ROLES]:-0}" = 1 ]; then
  [ "$CONTROL_PLANE" = 1 ] || die "--node-database-roles is the control plane's setting (with --control-plane); a node gets its role when it joins"
  [[ "${SET[DATABASE_URL]:-}" =~ ^postgres(ql)?:// ]] || die "--node-database-roles needs --database-url (PostgreSQL): SQLite has no roles"
fi
if [ "$CONTROL_PLANE" = 0 ]; then
  # It joins with an operator's token (nodes.join): the control plane gives unknown machines no work.
  [ -n "${SET[AENV_CONTROL_PLANE_URL]:-}" ] || die "a node joining a cluster needs --control-plane-url (the API it joins at, e.g. https://api.example:3000)"
  [ -n "${SET[AENV_NODE_JOIN_TOKEN]:-}" ] || die "a node joining a cluster needs --join-token (manage.py node_tokens create --node-id ${SET[AENV_NODE_ID]} on the control plane, or its dashboard's nodes page)"
fi
: "${SET[CELERY_BROKER_URL]:=redis://127.0.0.1:6379/0}"
LOCAL_REDIS_ACL=0
if [ "$CONTROL_PLANE" = 1 ] && [[ "${SET[CELERY_BROKER_URL]}" =~ ^redis://(127\.0\.0\.1|localhost)(:6379)?(/0)?$ ]]; then
  # This machine's Redis (Debian's system service) gets the ACL users too (no password-less
  # user): the processes here connect as aenv-control; the node password is kept in
  # $REDIS_NODE_PASSWORD_FILE for nodes that join later.
  LOCAL_REDIS_ACL=1
  REDIS_CONTROL_PASSWORD="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
  REDIS_NODE_PASSWORD="$(python3 -c 'import secrets; print(secrets.token_hex(32))')"
  for key in CELERY_BROKER_URL CELERY_RESULT_BACKEND AENV_CHANNEL_LAYER_URL; do
    if [[ "${SET[$key]:-}" =~ ^redis://(127\.0\.0\.1|localhost)(:6379)?(/[0-9]*)?$ ]]; then unset "SET[$key]"; fi
  done
  SET[CELERY_BROKER_URL]="redis://aenv-control:$REDIS_CONTROL_PASSWORD@127.0.0.1:6379/0"
fi
if [ -n "$BROKER_CA" ]; then
  # TLS to the broker, verified against this CA (docs/security.md, The broker).
  [[ "${SET[CELERY_BROKER_URL]}" =~ ^rediss:// ]] || die "--broker-ca is for a TLS broker: give a rediss:// --broker-url"
  [[ "$BROKER_CA" = /* ]] || die "--broker-ca: an absolute path (the units do not run in this directory)"
  [ "$DRY_RUN" = 1 ] || [ -r "$BROKER_CA" ] || die "--broker-ca: cannot read $BROKER_CA"
  tls_query="ssl_cert_reqs=required&ssl_ca_certs=$BROKER_CA"
  if [[ "${SET[CELERY_BROKER_URL]}" != *"$tls_query"* ]]; then  # a second run finds it there already
    [[ "${SET[CELERY_BROKER_URL]}" != *ssl_ca_certs=* ]] || die "--broker-ca: the --broker-url names another CA already (ssl_ca_certs)"
    case "${SET[CELERY_BROKER_URL]}" in *\?*) sep="&" ;; *) sep="?" ;; esac
    SET[CELERY_BROKER_URL]="${SET[CELERY_BROKER_URL]}${sep}$tls_query"
  fi
fi
if [[ "${SET[CELERY_BROKER_URL]}" =~ ^(rediss?://[^/?]*)(/[0-9]*)?(\?.*)?$ ]]; then
  redis_base="${BASH_REMATCH[1]}" redis_query="${BASH_REMATCH[3]}"
  : "${SET[CELERY_RESULT_BACKEND]:=$redis_base/1$redis_query}"
  : "${SET[AENV_CHANNEL_LAYER_URL]:=$redis_base/2$redis_query}"
  # Redis on another host: never without its ACL user (deploy/redis/users.acl.template).
  if [[ ! "$redis_base" =~ ^redis://(127\.0\.0\.1|localhost)(:[0-9]+)?$ ]] && [[ ! "$redis_base" =~ ^rediss?://[^@/]+:[^@/]+@ ]]; then
    die "--broker-url: a Redis on another host needs a user and password (redis://aenv-node-${SET[AENV_NODE_ID]}:PASSWORD@host:6379/0, or rediss://... with ?ssl_cert_reqs=required&ssl_ca_certs=/path/ca.pem; see docs/security.md)"
  fi
  # Celery refuses a rediss:// result backend that does not say how to verify the broker.
  if [[ "$redis_base" =~ ^rediss:// ]] && [[ "$redis_query" != *ssl_cert_reqs=* ]]; then
    die "--broker-url: a rediss:// broker needs --broker-ca PATH (or ?ssl_cert_reqs=required&ssl_ca_certs=PATH)"
  fi
  # A per-node user may consume only its own queue: it must be this node's.
  if [[ "$redis_base" =~ ^rediss?://aenv-node-([^:@/]+): ]] && [ "${BASH_REMATCH[1]}" != "${SET[AENV_NODE_ID]}" ]; then
    die "--broker-url: Redis user aenv-node-${BASH_REMATCH[1]} is another node's (queue node.${BASH_REMATCH[1]}); this node is ${SET[AENV_NODE_ID]}: use aenv-node-${SET[AENV_NODE_ID]}"
  fi
else
  if [ -z "${SET[CELERY_RESULT_BACKEND]:-}" ] || [ -z "${SET[AENV_CHANNEL_LAYER_URL]:-}" ]; then
    die "with a broker that is not Redis, give --result-url and --channel-layer-url too"
  fi
fi
case "${SET[AENV_NETWORK]:-auto}" in auto|netns|slirp) ;; *) die "--network must be auto, netns or slirp" ;; esac
if [ -n "${SET[AENV_NET_INGRESS_FROM]:-}" ]; then
  IFS=, read -ra sources <<< "${SET[AENV_NET_INGRESS_FROM]}"
  for source in "${sources[@]}"; do
    [[ "$source" =~ ^[0-9]{1,3}(\.[0-9]{1,3}){3}(/[0-9]{1,2})?$ ]] \
      || die "--net-ingress-from: '$source' is not an IPv4 address or CIDR (comma-separated, e.g. 10.0.0.2,10.0.1.0/24)"
  done
  [ "${SET[AENV_NETWORK]:-auto}" != slirp ] || die "--net-ingress-from is for the netns network (slirp's forwards cannot limit who connects)"
fi
: "${SET[AENV_SNAPSHOT_BACKEND]:=posix_fs}"
case "${SET[AENV_SNAPSHOT_BACKEND]}" in
  posix_fs) for key in AENV_S3_BUCKET AENV_S3_ENDPOINT AENV_S3_REGION AENV_S3_PREFIX; do
              [ -z "${FLAG[$key]:-}" ] || die "the --s3-* options need --store s3"; done ;;
  s3) [ -n "${SET[AENV_S3_BUCKET]:-}" ] || die "--store s3 needs --s3-bucket" ;;
  *) die "--store must be posix_fs or s3, not '${SET[AENV_SNAPSHOT_BACKEND]}'" ;;
esac
# Signed node tasks (nodes.signing): the control plane makes its key pair in TASK_SIGNING_DIR
# (step 4); a node is given the certificate only.
TASK_SIGNING_DIR=/etc/aenv/task-signing
if [ "$CONTROL_PLANE" = 1 ]; then
  : "${SET[AENV_TASK_SIGNING_KEY]:=$TASK_SIGNING_DIR/key.pem}" "${SET[AENV_TASK_SIGNING_CERT]:=$TASK_SIGNING_DIR/cert.pem}"
else
  [ -n "${SET[AENV_TASK_SIGNING_CERT]:-}" ] || die "a node joining a cluster needs --task-cert (a copy of the control plane's $TASK_SIGNING_DIR/cert.pem): it runs only tasks signed with that certificate's key"
  [[ "${SET[AENV_TASK_SIGNING_CERT]}" = /* ]] || die "--task-cert: an absolute path (the units do not run in this directory)"
  { [ "$DRY_RUN" = 1 ] && [ ! -e "${SET[AENV_TASK_SIGNING_CERT]}" ]; } \
    || grep -q "BEGIN CERTIFICATE" "${SET[AENV_TASK_SIGNING_CERT]}" 2>/dev/null || die "--task-cert: ${SET[AENV_TASK_SIGNING_CERT]} is not a readable PEM certificate"
fi
SECRET_GENERATED=0
if [ "$CONTROL_PLANE" = 1 ] && [ -z "${SET[DJANGO_SECRET_KEY]:-}" ]; then
  # The API, data plane and sweeper run as user aenv and must share one key (a key file the
  # root node wrote first would be unreadable to them); other control-plane machines get it by --secret-key.
  SECRET_GENERATED=1
  SET[DJANGO_SECRET_KEY]="$(python3 -c 'import secrets; print(secrets.token_urlsafe(50))')"
fi
for key in "${!SET[@]}"; do
  [[ "${SET[$key]}" != *"'"* && "${SET[$key]}" != *$'\n'* ]] || die "$key: values may not hold a single quote or a newline"
done

env_file_text() {  # the settings, one KEY=value a line, quoted where systemd or a shell would split
  local order=(AENV_HOME AENV_NODE_ID AENV_NODE_ADDRESS AENV_CONTROL_PLANE_URL AENV_NODE_JOIN_TOKEN DATABASE_URL CELERY_BROKER_URL CELERY_RESULT_BACKEND
               AENV_CHANNEL_LAYER_URL AENV_NETWORK AENV_NET_POOL AENV_NET_INGRESS_FROM AENV_SNAPSHOT_BACKEND AENV_S3_BUCKET AENV_S3_ENDPOINT
               AENV_S3_REGION AENV_S3_PREFIX AWS_ACCESS_KEY_ID AWS_SECRET_ACCESS_KEY DJANGO_SECRET_KEY
               AENV_TASK_SIGNING_KEY AENV_TASK_SIGNING_CERT AENV_NODE_DATABASE_ROLES
               AENV_SANDBOX_DOMAIN AENV_API_PUBLIC_URL AENV_SANDBOX_PUBLIC_URL)
  local key value
  echo "# aenv settings (config/settings.py), written by deploy/install-node.sh; read by the aenv-* units."
  for key in "${order[@]}"; do
    value="${SET[$key]:-}"
    [ -n "$value" ] || continue
    if [ "$DRY_RUN" = 1 ] && [ "$key" = DJANGO_SECRET_KEY ] && [ "$SECRET_GENERATED" = 1 ]; then
      value="<generated>"
    fi
    if [[ "$value" =~ ^[A-Za-z0-9_./:@%+,=-]+$ ]]; then echo "$key=$value"; else echo "$key='$value'"; fi
  done
}

render_unit() {  # $1: unit file name → the unit for this checkout, home and settings file
  sed -e "s#$UNIT_PREFIX#$ROOT#g" -e "s#$UNIT_HOME#$HOME_DIR#g" -e "s#$UNIT_ENV_FILE#$ENV_FILE#g" "$UNITS_SRC/$1"
}

run() {  # a command, or in a dry run its line
  if [ "$DRY_RUN" = 1 ]; then printf '+'; printf ' %q' "$@"; echo; else "$@"; fi
}

put_file_append() {  # path: stdin appended to path (shown in a dry run)
  if [ "$DRY_RUN" = 1 ]; then echo "=== $1 (append) ==="; cat; echo "=== end $1 ==="; else cat >> "$1"; fi
}

put_file() {  # path mode: stdin into path (shown whole in a dry run)
  if [ "$DRY_RUN" = 1 ]; then
    echo "=== $1 (mode $2) ==="
    cat
    echo "=== end $1 ==="
  else
    mkdir -p "$(dirname "$1")"
    local tmp="$1.tmp.$$"
    (umask 077; cat > "$tmp")
    chmod "$2" "$tmp" && mv -f "$tmp" "$1"
  fi
}

UNITS=(aenv-node.service)
[ "$CONTROL_PLANE" = 1 ] && UNITS=(aenv-api.service aenv-dataplane.service aenv-sweeper.service aenv-events.service "${UNITS[@]}")
if [ "$DRY_RUN" = 0 ] && [ "$(id -u)" != 0 ]; then die "run as root (the node worker's units, packages and /etc/aenv), or pass --dry-run"; fi
echo "==> aenv node ${SET[AENV_NODE_ID]} from $ROOT (home $HOME_DIR; units: ${UNITS[*]})"

# 1. Packages and the venv: scripts/setup.sh's own steps (its package list is the only one).
export AENV_HOME="$HOME_DIR"
# shellcheck source=SCRIPTDIR/../scripts/setup.sh
source "$ROOT/scripts/setup.sh"
run setup_system_packages --node
run setup_python_env
run setup_egress_proxy_env
if [ "$CONTROL_PLANE" = 1 ]; then
  run "$ROOT/deploy/dashboard-assets.sh"
  run "$ROOT/.venv/bin/python" "$ROOT/manage.py" collectstatic --noinput -v 0
  if [[ "${SET[CELERY_BROKER_URL]}" =~ ^redis://([^@/]*@)?(127\.0\.0\.1|localhost)[:/] ]]; then
    # A local broker is a system service here, not setup.sh's background redis-server.
    dpkg-query -W -f='${Status}' redis-server 2>/dev/null | grep -q "install ok installed" \
      || run env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server
  fi
  if [ "$LOCAL_REDIS_ACL" = 1 ]; then
    REDIS_CONTROL_PASSWORD="$REDIS_CONTROL_PASSWORD" REDIS_NODE_PASSWORD="$REDIS_NODE_PASSWORD" \
      sh "$ROOT/deploy/redis/render-acl.sh" | put_file "$REDIS_ACL_FILE" 640
    printf '%s\n' "$REDIS_NODE_PASSWORD" | put_file "$REDIS_NODE_PASSWORD_FILE" 600
    run chown redis:redis "$REDIS_ACL_FILE"
    if [ "$DRY_RUN" = 1 ] || ! grep -qx "aclfile $REDIS_ACL_FILE" /etc/redis/redis.conf; then
      echo "aclfile $REDIS_ACL_FILE" | put_file_append /etc/redis/redis.conf
    fi
    run systemctl restart redis-server
  fi
fi

# 2. The settings file and AENV_HOME.
env_file_text | put_file "$ENV_FILE" 600
run mkdir -p "$HOME_DIR"
if [ "$CONTROL_PLANE" = 1 ]; then
  # The API, data plane and sweeper run as aenv; on one machine they share AENV_HOME with the
  # root node worker (group aenv, setgid, the node's umask 0007: see deploy/systemd/aenv-api.service).
  id aenv >/dev/null 2>&1 || run useradd --system --user-group --home-dir "$HOME_DIR" --shell /usr/sbin/nologin aenv
  run chown aenv:aenv "$HOME_DIR"
  run chmod 2770 "$HOME_DIR"
  if [ "$DRY_RUN" = 0 ] && ! runuser -u aenv -- test -r "$ROOT/manage.py"; then
    die "user aenv cannot read $ROOT: put the checkout where it can (e.g. /opt/aenv)"
  fi
fi

# 3. The guest images (a few minutes the first time; cached, rebuilt only when a recipe changes).
if [ "$IMAGES" = 1 ]; then run setup_guest_images; fi

# 4. The schema and the default team + API key (control plane only: nodes never migrate).
if [ "$CONTROL_PLANE" = 1 ]; then
  # shellcheck disable=SC2016  # the settings file is sourced by the inner shell, as user aenv
  as_aenv() { run runuser -u aenv -- env "AENV_ENV_FILE=$ENV_FILE" bash -c \
    'set -a; . "$AENV_ENV_FILE"; set +a; exec "$@"' aenv "$@"; }
  # The task-signing pair, unless it exists: the key readable by group aenv (the API, data
  # plane and sweeper sign), nobody else. Made before any process reads the settings naming it.
  run env -u AENV_TASK_SIGNING_KEY -u AENV_TASK_SIGNING_CERT "$ROOT/.venv/bin/python" "$ROOT/manage.py" \
    task_signing_keys --dir "$TASK_SIGNING_DIR"
  run chgrp -R aenv "$TASK_SIGNING_DIR"
  run chmod 750 "$TASK_SIGNING_DIR"
  run chmod 640 "$TASK_SIGNING_DIR/key.pem"
  echo "==> nodes on other hosts: copy $TASK_SIGNING_DIR/cert.pem (never key.pem) there and pass --task-cert"
  as_aenv "$ROOT/.venv/bin/python" "$ROOT/manage.py" migrate --noinput -v 0
  as_aenv "$ROOT/.venv/bin/python" "$ROOT/manage.py" bootstrap
fi

# 5. The units.
for unit in aenv.target "${UNITS[@]}"; do
  render_unit "$unit" | put_file "$SYSTEMD_DIR/$unit" 644
done
if [ "$DRY_RUN" = 1 ] || [ -d /run/systemd/system ]; then
  run systemctl daemon-reload
  run systemctl enable aenv.target "${UNITS[@]}"
  run systemctl restart "${UNITS[@]}"
else
  echo "==> systemd is not running here: units written to $SYSTEMD_DIR, not started"
fi
echo "==> done: systemctl status aenv.target; logs: journalctl -u 'aenv-*'"

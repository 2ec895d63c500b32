#!/bin/sh
# Renders deploy/redis/users.acl.template into a Redis ACL file: the passwords of the
# control-plane user (aenv-control), the node role user (aenv-node) and one user per node
# (aenv-node-<id>) become SHA-256 hashes, so the file holds no password. POSIX sh + sed +
# sha256sum: it runs in the redis:7 image too.
#
#   REDIS_CONTROL_PASSWORD=... REDIS_NODE_PASSWORD=... deploy/redis/render-acl.sh [TEMPLATE] > users.acl
#   REDIS_CONTROL_PASSWORD=... NODE_IDS="node-1 node-2" REDIS_NODE_PASSWORD_NODE_1=... \
#     REDIS_NODE_PASSWORD_NODE_2=... deploy/redis/render-acl.sh > users.acl
#
# NODE_IDS (space-separated; also the arguments after TEMPLATE) renders aenv-node-<id> for
# each, with its own password REDIS_NODE_PASSWORD_<ID> (<id> upper-cased, '.' and '-' as '_'):
# only its own queue node.<id>. REDIS_NODE_PASSWORD is then optional: without it the shared
# role user aenv-node is rendered off (no login); Kubernetes needs it (docs/security.md).
# Each password must be at least 32 characters of [A-Za-z0-9_-] (openssl rand -hex 32), so it
# goes into a redis:// or rediss:// URL (redis://aenv-node-node-2:PASSWORD@broker:6379/0) as it is.
set -eu
template="${1:-$(dirname "$0")/users.acl.template}"
[ "$#" -gt 0 ] && shift
node_ids="${NODE_IDS:-} $*"

hash_of() {  # $1: the variable's name, $2: its value
  value="$2"
  case "$value" in
    *[!A-Za-z0-9_-]*) echo "render-acl: $1 may hold only A-Z a-z 0-9 _ -" >&2; exit 2 ;;
  esac
  if [ "${#value}" -lt 32 ]; then
    echo "render-acl: set $1 to at least 32 characters (openssl rand -hex 32)" >&2; exit 2
  fi
  printf '%s' "$value" | sha256sum | cut -d' ' -f1
}

password_variable() {  # $1: a node id -> REDIS_NODE_PASSWORD_<ID>
  printf 'REDIS_NODE_PASSWORD_%s' "$(printf '%s' "$1" | tr 'a-z.-' 'A-Z__')"
}

control=$(hash_of REDIS_CONTROL_PASSWORD "${REDIS_CONTROL_PASSWORD:-}")
# shellcheck disable=SC2086 # word splitting of the id list is the point
set -- $node_ids
if [ -n "${REDIS_NODE_PASSWORD:-}" ] || [ "$#" -eq 0 ]; then
  role="on resetpass #$(hash_of REDIS_NODE_PASSWORD "${REDIS_NODE_PASSWORD:-}")"
else
  role="off resetpass"  # no password at all: nobody logs in as the shared node user
fi
for id in "$@"; do  # every id checked and every password hashed before anything is printed
  case "$id" in
    [a-z0-9]*) ;;
    *) echo "render-acl: node id '$id': lower-case letters, digits, '.', '_' or '-'" >&2; exit 2 ;;
  esac
  case "$id" in
    *[!a-z0-9._-]*) echo "render-acl: node id '$id': lower-case letters, digits, '.', '_' or '-'" >&2; exit 2 ;;
  esac
  variable=$(password_variable "$id")
  hash_of "$variable" "$(printenv "$variable" || true)" > /dev/null
done
sed -e '/^#/d' -e '/^[[:space:]]*$/d' -e '/{{NODE_ID}}/d' \
    -e "s/{{CONTROL_PASSWORD_SHA256}}/$control/" -e "s/{{NODE_ROLE_LOGIN}}/$role/" "$template"
separator=$(printf '\006\026')  # kombu's priority queues: node.<id>\x06\x16<priority>
for id in "$@"; do
  variable=$(password_variable "$id")
  hash=$(hash_of "$variable" "$(printenv "$variable" || true)")
  sed -n -e '/^user aenv-node-{{NODE_ID}} /!d' \
      -e "s/{{NODE_ID}}/$id/g" -e "s/{{NODE_ID_PASSWORD_SHA256}}/$hash/" \
      -e "s/{{PRIORITY_SEPARATOR}}/$separator/" -e p "$template"
done

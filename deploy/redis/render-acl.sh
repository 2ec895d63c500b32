#!/bin/sh
# Renders deploy/redis/users.acl.template into a Redis ACL file: the passwords of the
# control-plane user (aenv-control) and the node user (aenv-node) become SHA-256 hashes, so
# the file holds no password. POSIX sh + sed + sha256sum: it runs in the redis:7 image too.
#
#   REDIS_CONTROL_PASSWORD=... REDIS_NODE_PASSWORD=... deploy/redis/render-acl.sh [TEMPLATE] > users.acl
#
# Each password must be at least 32 characters of [A-Za-z0-9_-] (openssl rand -hex 32), so it
# goes into a redis:// or rediss:// URL (redis://aenv-node:PASSWORD@broker:6379/0) as it is.
set -eu
template="${1:-$(dirname "$0")/users.acl.template}"

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

control=$(hash_of REDIS_CONTROL_PASSWORD "${REDIS_CONTROL_PASSWORD:-}")
node=$(hash_of REDIS_NODE_PASSWORD "${REDIS_NODE_PASSWORD:-}")
sed -e '/^#/d' -e '/^[[:space:]]*$/d' \
    -e "s/{{CONTROL_PASSWORD_SHA256}}/$control/" -e "s/{{NODE_PASSWORD_SHA256}}/$node/" "$template"

#!/bin/sh
# The entrypoint of Dockerfile.postgres: initdb into the volume on the first start (superuser
# and database $POSTGRES_USER, password $POSTGRES_PASSWORD, scram over TCP from anywhere on the
# container network; trust on the local socket, inside the container only), then the server.
set -eu
DATA=/var/lib/postgresql/data
BIN=/usr/lib/postgresql/15/bin
USER_NAME="${POSTGRES_USER:-aenv}"
DB_NAME="${POSTGRES_DB:-$USER_NAME}"
if [ ! -s "$DATA/PG_VERSION" ]; then
  : "${POSTGRES_PASSWORD:?set POSTGRES_PASSWORD}"
  pwfile="$(mktemp)"
  printf '%s\n' "$POSTGRES_PASSWORD" > "$pwfile"
  "$BIN/initdb" -D "$DATA" -U "$USER_NAME" --pwfile="$pwfile" --auth-local=trust \
    --auth-host=scram-sha-256 --encoding=UTF8 --locale=C.UTF-8 >/dev/null
  rm -f "$pwfile"
  echo "host all all all scram-sha-256" >> "$DATA/pg_hba.conf"
  if [ "$DB_NAME" != postgres ]; then
    echo "CREATE DATABASE \"$DB_NAME\" OWNER \"$USER_NAME\";" | "$BIN/postgres" --single -D "$DATA" postgres >/dev/null
  fi
  echo "postgres-entrypoint: made the cluster (user $USER_NAME, database $DB_NAME)" >&2
fi
exec "$BIN/postgres" -D "$DATA" -c listen_addresses='*' "$@"

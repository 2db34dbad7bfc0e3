# Shared by run.sh and trace.sh (sourced): `setup ADMIN_URL DATABASE SCRIPT PACKAGE...` checks the
# release binary and the URL, installs the npm packages and SCRIPT into a temporary directory
# (removed on exit), and makes a fresh, migrated DATABASE on the URL's server. Sets `binary`,
# `db` (the new database's URL) and `work` (the directory).
setup() {
    local admin=$1 database=$2 script=$3
    shift 3
    local here
    here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
    binary=$(cd "$here/../.." && pwd)/target/release/outbox-relay
    [ -x "$binary" ] || { echo "build the release binary first: cargo build --release" >&2; exit 2; }
    [[ $admin =~ ^postgres(ql)?://[^?]*/[^/?]+$ ]] || { echo "give a URL of the form postgresql://user@host:port/database, without parameters" >&2; exit 2; }
    db=${admin%/*}/$database
    work=$(mktemp -d)
    trap 'rm -rf "$work"' EXIT
    cp "$here/$script" "$work/"
    (cd "$work" && npm init -y >/dev/null && npm install --no-audit --no-fund --silent "$@" >/dev/null)
    psql -XAtq -v ON_ERROR_STOP=1 "$admin" -c "drop database if exists $database" -c "create database $database" 2>/dev/null
    DATABASE_URL=$db RUST_LOG=error "$binary" migrate >/dev/null
}

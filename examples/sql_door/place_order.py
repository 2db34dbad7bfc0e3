"""Places an order the way the article does, from Python (psycopg 3), with outbox-relay's unit of
work in SQL: the order, its audit entry, its idempotency receipt and its event in one
transaction; the same key again replays the stored response and writes nothing.

    pip install 'psycopg[binary]>=3.1'
    DATABASE_URL=postgres://... python3 place_order.py ORDER-KEY CUSTOMER TOTAL

Prints the response as JSON and whether it was a replay, e.g.
{"response": {"order_id": 1}, "replayed": false}. Exit status 3 when the key was used for
another request (SQLSTATE OR001), 2 for bad arguments.
"""

import json
import os
import sys

import psycopg
from psycopg.types.json import Jsonb

# The business table of this example (a real service has its own).
ORDERS = """create table if not exists orders (
    id bigserial primary key, customer text not null, total numeric(12, 2) not null)"""


def place_order(conn: psycopg.Connection, key: str, request: dict) -> tuple[dict, bool]:
    """The unit of work: (response, replayed)."""
    with conn.transaction():
        # Null: the request is fresh and the key is now this transaction's. Otherwise the stored
        # response of the first request with this key (which this call waited for if it was
        # still running).
        stored = conn.execute("select outbox_relay.begin_request(%s, %s)", (key, Jsonb(request))).fetchone()[0]
        if stored is not None:
            return stored, True
        order_id = conn.execute(
            "insert into orders (customer, total) values (%s, %s) returning id",
            (request["customer"], request["total"]),
        ).fetchone()[0]
        conn.execute(
            "select outbox_relay.audit('order', %s, 'placed', %s, %s)", (str(order_id), Jsonb(request), key)
        )
        conn.execute(
            "select outbox_relay.publish('order.placed', %s, %s)",
            (Jsonb({"order_id": order_id, "customer": request["customer"]}), str(order_id)),
        )
        response = {"order_id": order_id}
        conn.execute("select outbox_relay.store_response(%s, %s)", (key, Jsonb(response)))
        return response, False


def main() -> int:
    if len(sys.argv) != 4:
        print("usage: place_order.py ORDER-KEY CUSTOMER TOTAL", file=sys.stderr)
        return 2
    key, customer, total = sys.argv[1:]
    url = os.environ.get("DATABASE_URL")
    if not url:
        print("set DATABASE_URL to the service's database", file=sys.stderr)
        return 2
    with psycopg.connect(url, autocommit=True) as conn:
        if conn.execute("select to_regclass('orders') is null").fetchone()[0]:
            conn.execute(ORDERS)
        try:
            response, replayed = place_order(conn, key, {"customer": customer, "total": total})
        except psycopg.Error as e:
            if e.sqlstate == "OR001":
                print(f"refused: {e.diag.message_primary}", file=sys.stderr)
                return 3
            raise
    print(json.dumps({"response": response, "replayed": replayed}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

// Places an order the way the article does, from Node.js (node-postgres), with outbox-relay's
// unit of work in SQL: the order, its audit entry, its idempotency receipt and its event in one
// transaction; the same key again replays the stored response and writes nothing.
//
//   npm ci                      # in this folder: node-postgres, as package-lock.json pins it
//   DATABASE_URL=postgres://... node place_order.mjs ORDER-KEY CUSTOMER TOTAL
//
// Prints the response as JSON and whether it was a replay, e.g.
// {"response":{"order_id":1},"replayed":false}. Exit status 3 when the key was used for another
// request (SQLSTATE OR001), 2 for bad arguments.

import pg from "pg";

// The business table of this example (a real service has its own).
const ORDERS = `create table if not exists orders (
    id bigserial primary key, customer text not null, total numeric(12, 2) not null)`;

/** The unit of work: { response, replayed }. */
export async function placeOrder(client, key, request) {
  await client.query("begin");
  try {
    // Null: the request is fresh and the key is now this transaction's. Otherwise the stored
    // response of the first request with this key (which this call waited for if it was still
    // running). jsonb parameters are passed as JSON text.
    const { rows: [{ stored }] } = await client.query(
      "select outbox_relay.begin_request($1, $2) as stored", [key, JSON.stringify(request)]);
    if (stored !== null) {
      await client.query("rollback");
      return { response: stored, replayed: true };
    }
    const { rows: [{ id }] } = await client.query(
      "insert into orders (customer, total) values ($1, $2) returning id", [request.customer, request.total]);
    await client.query("select outbox_relay.audit('order', $1, 'placed', $2, $3)",
      [String(id), JSON.stringify(request), key]);
    await client.query("select outbox_relay.publish('order.placed', $1, $2)",
      [JSON.stringify({ order_id: Number(id), customer: request.customer }), String(id)]);
    const response = { order_id: Number(id) };
    await client.query("select outbox_relay.store_response($1, $2)", [key, JSON.stringify(response)]);
    await client.query("commit");
    return { response, replayed: false };
  } catch (e) {
    await client.query("rollback");
    throw e;
  }
}

async function main() {
  const args = process.argv.slice(2);
  if (args.length !== 3) {
    console.error("usage: place_order.mjs ORDER-KEY CUSTOMER TOTAL");
    return 2;
  }
  const [key, customer, total] = args;
  if (!process.env.DATABASE_URL) {
    console.error("set DATABASE_URL to the service's database");
    return 2;
  }
  const client = new pg.Client({ connectionString: process.env.DATABASE_URL });
  await client.connect();
  try {
    const { rows: [{ missing }] } = await client.query("select to_regclass('orders') is null as missing");
    if (missing) await client.query(ORDERS);
    const placed = await placeOrder(client, key, { customer, total });
    console.log(JSON.stringify(placed));
    return 0;
  } catch (e) {
    if (e.code === "OR001") {
      console.error(`refused: ${e.message}`);
      return 3;
    }
    throw e;
  } finally {
    await client.end();
  }
}

process.exitCode = await main();

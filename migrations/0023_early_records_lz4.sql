-- The ids of a record early (migration 0017) compressed with lz4 instead of pglz.
--
-- While a held claim delivers a backlog, its relay writes the ids delivered since its last
-- record into `early_deliveries` every `record_every` (20 ms): at 110,000 events/s about 2,200
-- ids, an array of 17 kB, which PostgreSQL compresses before it stores it out of line. With its
-- default method (pglz) that compression took 1.6 ms of the server's CPU per row, about 8 % of a
-- core beside a drain; lz4 takes about 0.1 ms (pgbench, an insert of 2,000 consecutive ids,
-- synchronous_commit off: 1.87 to 2.17 ms with pglz, 0.41 to 0.47 ms with lz4, 0.30 to 0.36 ms
-- building the array alone; docs/performance.md). Only rows written from now on use it.
--
-- lz4 is there when the server was built with it (the PGDG and Debian packages, the official
-- images are); a server without it keeps pglz (the notice below goes to the migrating session
-- only: the relay's log does not show it).
--
-- Like any ALTER TABLE, this takes the table's ACCESS EXCLUSIVE lock until the migration commits:
-- claims read `early_deliveries`, so while relays run it waits for the claims in delivery to end
-- (at most their `hold`) and new claims wait for it. A dump of the schema now sets the column's
-- compression: restoring it into a server without lz4 fails that one statement
-- (`pg_restore --no-toast-compression` leaves it out).
do $$
begin
    alter table outbox_relay.early_deliveries alter column ids set compression lz4;
exception when feature_not_supported then
    raise notice 'this PostgreSQL server has no lz4 (%): early_deliveries.ids stays compressed with pglz', sqlerrm;
end
$$;

-- The concurrency limit each relay has learnt for its destination, for `outbox-relay status`
-- (issue 21).
--
-- A relay's limit changes with its receiver; the relay writes it (and the deliveries it has in
-- flight) here at most once a second, only when one of them changed, so an idle relay writes
-- nothing. Both are null until the relay first publishes them.

alter table outbox_relay.relays
    add column delivery_limit integer,
    add column deliveries_in_flight integer,
    add constraint relays_delivery_limit_valid check (delivery_limit > 0),
    add constraint relays_deliveries_in_flight_valid check (deliveries_in_flight >= 0);

comment on column outbox_relay.relays.delivery_limit is
    'The concurrency limit in effect: deliveries the relay may have in flight at once (learnt, up to its ceiling, or fixed).';
comment on column outbox_relay.relays.deliveries_in_flight is
    'Deliveries the relay had in flight when it last wrote its limit.';

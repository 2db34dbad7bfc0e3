-- The article's own tables (as `outbox-relay bench` creates them) and the business table.
create table if not exists bench_orders (
    id         bigserial primary key,
    customer   text not null,
    total      float8 not null,
    created_at timestamptz not null default now()
);
create table if not exists bench_article_outbox (
    id           bigserial primary key,
    topic        text not null,
    payload      jsonb not null,
    available_at timestamptz not null default now(),
    processed_at timestamptz,
    attempts     int not null default 0,
    last_error   text
);
create table if not exists bench_article_audit (
    id        bigserial primary key,
    entity    text not null,
    entity_id text not null,
    action    text not null,
    data      jsonb not null,
    at        timestamptz not null default now()
);
create table if not exists bench_article_idempotency (
    key        text primary key,
    response   jsonb not null,
    created_at timestamptz not null default now()
);

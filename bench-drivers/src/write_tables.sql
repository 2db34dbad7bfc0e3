-- The write path's business table, and the article's own tables as it creates them (its outbox,
-- audit and receipts: no trigger, no check, no function), for the plain-tables way. Created by
-- `outbox-relay bench` (bench-drivers/src/write.rs) and by benches/write_path/run.sh alike.
create table if not exists public.bench_orders (
    id         bigserial primary key,
    customer   text not null,
    total      float8 not null,
    created_at timestamptz not null default now()
);
create table if not exists public.bench_article_outbox (
    id           bigserial primary key,
    topic        text not null,
    payload      jsonb not null,
    available_at timestamptz not null default now(),
    processed_at timestamptz,
    attempts     int not null default 0,
    last_error   text
);
create table if not exists public.bench_article_audit (
    id        bigserial primary key,
    entity    text not null,
    entity_id text not null,
    action    text not null,
    data      jsonb not null,
    at        timestamptz not null default now()
);
create table if not exists public.bench_article_idempotency (
    key        text primary key,
    response   jsonb not null,
    created_at timestamptz not null default now()
);

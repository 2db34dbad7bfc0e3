//! What the outbox trigger does during a measurement: disabled, as shipped, or notifying on
//! every commit. The trigger itself is the migrations' own: it is disabled and enabled, never
//! re-created here.

use pg_outbox_relay::Outbox;

use super::{BoxError, db};

const TRIGGER_DISABLE: &str = "alter table outbox_relay.outbox disable trigger outbox_notify_relay";
const TRIGGER_ENABLE: &str = "alter table outbox_relay.outbox enable trigger outbox_notify_relay";
/// A stand-in for an idle relay (real relays have positive ids), so that every insert notifies.
const PLACEHOLDER_MARK: &str = "\
insert into outbox_relay.relays (id, listener_pid, waiting) values (-1, pg_backend_pid(), true)
on conflict (id) do update set waiting = true";
const PLACEHOLDER_REMOVE: &str = "delete from outbox_relay.relays where id = -1";

/// Enables (`true`) or disables (`false`) the trigger `outbox_notify_relay`, which sends the
/// relay's `NOTIFY` on inserts into the outbox. Takes a lock on the outbox table: do not call it
/// while a relay runs.
pub async fn set_notify_trigger(outbox: &Outbox, enabled: bool) -> Result<(), BoxError> {
    let client = outbox.connection().await?;
    let sql = if enabled { TRIGGER_ENABLE } else { TRIGGER_DISABLE };
    client.batch_execute(sql).await.map_err(db("changing the outbox trigger"))?;
    Ok(())
}

/// What the outbox trigger does during a write measurement (no relay runs then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotifyMode {
    /// The trigger disabled: the floor.
    NoTrigger,
    /// The trigger as shipped, with no relay waiting: writers check `outbox_relay.relays` and do
    /// not notify. What writers pay under sustained load, when the relay lingers instead of
    /// waiting.
    Trigger,
    /// The trigger with a relay marked waiting (a placeholder, id -1): every commit sends
    /// `NOTIFY`. What writers pay while a relay is idle, and what a trigger that always notifies
    /// costs.
    NotifyEveryCommit,
}

impl NotifyMode {
    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            NotifyMode::NoTrigger => "no_trigger",
            NotifyMode::Trigger => "trigger",
            NotifyMode::NotifyEveryCommit => "notify_every_commit",
        }
    }
}

/// Sets the trigger up for `mode`. [`reset_notify`] restores the normal state.
pub async fn set_notify_mode(outbox: &Outbox, mode: NotifyMode) -> Result<(), BoxError> {
    set_notify_trigger(outbox, mode != NotifyMode::NoTrigger).await?;
    let client = outbox.connection().await?;
    let sql = if mode == NotifyMode::NotifyEveryCommit { PLACEHOLDER_MARK } else { PLACEHOLDER_REMOVE };
    client.batch_execute(sql).await.map_err(db("marking the placeholder relay"))?;
    Ok(())
}

/// Enables the trigger and removes [`set_notify_mode`]'s placeholder relay.
pub async fn reset_notify(outbox: &Outbox) -> Result<(), BoxError> {
    set_notify_trigger(outbox, true).await?;
    let client = outbox.connection().await?;
    client.batch_execute(PLACEHOLDER_REMOVE).await.map_err(db("removing the placeholder relay"))?;
    Ok(())
}

//! The console's page: plain server-rendered HTML, a little JavaScript (`console.js`) that
//! refreshes the figures and draws the latency chart, no build step.

use std::fmt::Write;
use std::time::Duration;

use pg_outbox_relay::{ConnectedRelay, DeadLetter, FoundEvent, Health, Pause, QueueStats};
use serde::Serialize;

use std::sync::Arc;

use pg_outbox_relay::sink::Secret;
use pg_outbox_relay::{Outbox, RelayMetrics};

/// What every request handler reads.
pub(crate) struct Console {
    pub(crate) outbox: Outbox,
    /// The outbox the metrics read (without the console's shorter timeout).
    pub(crate) exported: Outbox,
    /// Whether the console serves a relay (`run --http`), not only the database (`console`).
    pub(crate) has_relay: bool,
    /// Every destination's counters, by name: the relay's now (a reload of `--config` replaces
    /// them).
    pub(crate) destinations: std::sync::RwLock<Vec<(String, Arc<RelayMetrics>)>>,
    /// The CSRF token of this process, in every form.
    pub(crate) csrf: String,
    pub(crate) token: Option<Secret>,
    /// The session cookie's value after a login: random, per process.
    pub(crate) session: String,
    /// Whether the console is served at all (a loopback address, or a token set).
    pub(crate) console_allowed: bool,
    /// Whether the console needs the token.
    pub(crate) token_required: bool,
    pub(crate) loopback: bool,
    /// What recent actions did, shown once on the page they lead back to (by number, so that a
    /// link cannot make the page say something the console did not do).
    pub(crate) done: std::sync::Mutex<std::collections::VecDeque<(u64, String)>>,
    /// The relay's latency and rate, every few seconds, for the console's chart.
    pub(crate) history: std::sync::Mutex<std::collections::VecDeque<Sample>>,
}

impl Console {
    /// Every destination's counters, by name.
    pub(crate) fn destinations(&self) -> Vec<(String, Arc<RelayMetrics>)> {
        self.destinations.read().unwrap_or_else(std::sync::PoisonError::into_inner).clone()
    }

    /// The first destination's counters (the only one's, with a single sink): the console's
    /// summary and chart.
    pub(crate) fn relay(&self) -> Option<Arc<RelayMetrics>> {
        self.destinations.read().unwrap_or_else(std::sync::PoisonError::into_inner).first().map(|(_, m)| m.clone())
    }

    /// The counters of the relay that took over (a reload of `--config`).
    pub(crate) fn set_destinations(&self, destinations: Vec<(String, Arc<RelayMetrics>)>) {
        *self.destinations.write().unwrap_or_else(std::sync::PoisonError::into_inner) = destinations;
    }
}

/// One point of the console's latency chart.
#[derive(Debug, Clone, Copy, serde::Serialize)]
pub(crate) struct Sample {
    /// Unix time, milliseconds.
    pub(crate) at_ms: u64,
    /// Latency percentiles of recent deliveries (the relay's window of the last 4,096), ms.
    pub(crate) p50_ms: Option<f64>,
    pub(crate) p99_ms: Option<f64>,
    /// Events delivered per second since the sample before.
    pub(crate) rate: f64,
}

/// Dead letters the page lists.
const DEAD_LETTERS_SHOWN: i64 = 100;
/// Events a look-up shows.
const LOOKUP_SHOWN: i64 = 50;

/// What `/api/summary` returns and the page refreshes from.
#[derive(Serialize)]
pub(crate) struct Summary {
    stats: QueueStats,
    health: Health,
    warnings: Vec<String>,
    pauses: Vec<Pause>,
    relay: Option<RelaySummary>,
    /// Every registered destination, with this process's counters for the ones it delivers to.
    destinations: Vec<DestinationSummary>,
    history: Vec<Sample>,
}

#[derive(Serialize)]
struct DestinationSummary {
    #[serde(flatten)]
    stats: pg_outbox_relay::DestinationStats,
    /// This process's relay for it, when it runs one.
    relay: Option<RelaySummary>,
}

#[derive(Serialize)]
struct RelaySummary {
    delivered: u64,
    retried: u64,
    dead_lettered: u64,
    breaker_open: bool,
    listening: bool,
    delivery_limit: u64,
    deliveries_in_flight: u64,
    latency_p50_ms: Option<f64>,
    latency_p99_ms: Option<f64>,
}

pub(crate) async fn summary(console: &Console) -> pg_outbox_relay::Result<Summary> {
    let outbox = &console.outbox;
    let stats = outbox.queue_stats().await?;
    let health = outbox.health().await?;
    let pauses = outbox.pauses().await?;
    let ms = |d: Option<Duration>| d.map(|d| d.as_secs_f64() * 1000.0);
    let relay_summary = |m: &pg_outbox_relay::RelayMetrics| {
        let s = m.snapshot();
        RelaySummary {
            delivered: s.delivered,
            retried: s.retried,
            dead_lettered: s.dead_lettered,
            breaker_open: s.breaker_open,
            listening: s.listening,
            delivery_limit: s.delivery_limit,
            deliveries_in_flight: s.deliveries_in_flight,
            latency_p50_ms: ms(s.latency_p50),
            latency_p99_ms: ms(s.latency_p99),
        }
    };
    let relay = console.relay().as_deref().map(relay_summary);
    let counters = console.destinations();
    let destinations: Vec<DestinationSummary> = outbox
        .destinations()
        .await?
        .into_iter()
        .map(|stats| {
            let relay = counters.iter().find(|(name, _)| *name == stats.name).map(|(_, m)| relay_summary(m));
            DestinationSummary { stats, relay }
        })
        .collect();
    let history = console.history.lock().unwrap_or_else(|e| e.into_inner()).iter().copied().collect();
    let relays = outbox.connected_relays().await?;
    let mut warnings = queue_warnings(&stats, &pauses, &relays);
    let all: Vec<pg_outbox_relay::DestinationStats> = destinations.iter().map(|d| d.stats.clone()).collect();
    warnings.extend(destination_warnings(&all));
    warnings.extend(health.warnings());
    Ok(Summary { warnings, stats, health, pauses, relay, destinations, history })
}

/// Lines for a state of the queue that needs an operator: every topic paused with events ready,
/// events waiting and no relay connected, an open breaker, a relay far behind.
pub(crate) fn queue_warnings(stats: &QueueStats, pauses: &[Pause], relays: &[ConnectedRelay]) -> Vec<String> {
    let mut warnings = Vec::new();
    let all_paused = pauses.iter().any(|p| p.topic.is_none() && p.destination.is_none());
    if all_paused && stats.pending > 0 {
        warnings.push(format!(
            "every topic is paused and {} events are ready: nothing is delivered until `outbox-relay resume`",
            stats.pending
        ));
    }
    let waiting = stats.pending + stats.held_by_key + stats.delayed;
    if relays.is_empty() && waiting > 0 {
        warnings.push(format!("{waiting} events wait and no relay is connected to this database"));
    }
    let open: Vec<&str> =
        relays.iter().filter(|r| r.breaker_open).map(|r| r.destination.as_deref().unwrap_or("?")).collect();
    if !open.is_empty() {
        warnings.push(format!(
            "{} relay(s) found their destination down (breaker open: {}): they probe it, and claim nothing else for it",
            open.len(),
            open.join(", ")
        ));
    }
    if stats.unrouted > 0 {
        warnings.push(format!(
            "{} events matched no destination's pattern and went to the dead letters (destination ''): add a route for \
             their topics and retry them with `outbox-relay dead-letters retry`",
            stats.unrouted
        ));
    }
    if let Some(age) = stats.oldest_ready_age.filter(|age| *age >= LAG_WARNING && !all_paused) {
        warnings.push(format!(
            "the oldest ready event has waited {}: the relays are behind, its topic is paused, or they are down",
            humantime::format_duration(Duration::from_secs(age.as_secs()))
        ));
    }
    warnings
}

/// A warning per destination that events wait for and no relay delivers to (a route renamed or
/// removed keeps events in the outbox until its destination is dropped), and per paused one.
pub(crate) fn destination_warnings(destinations: &[pg_outbox_relay::DestinationStats]) -> Vec<String> {
    let mut warnings = Vec::new();
    for d in destinations {
        let waiting = d.new + d.due + d.delayed + d.in_flight;
        if !d.registered {
            warnings.push(format!(
                "{waiting} events wait for destination {}, which no relay registered: start a relay with a route of that \
                 name, or `outbox-relay destinations drop {}` moves them to its dead letters",
                d.name, d.name
            ));
        } else if d.relays == 0 && waiting > 0 {
            let since = d.unserved.map_or(String::new(), |u| format!(" (none has for {})", rounded(u)));
            let expiry = d.expires_in.map_or(String::new(), |e| {
                format!("; it expires in {}, and what waits for it then goes to its dead letters", rounded(e))
            });
            warnings.push(format!(
                "destination {}: {waiting} events wait for it and no relay delivers to it{since}{expiry} (if it is \
                 gone, `outbox-relay destinations drop {}` stops it keeping them)",
                d.name, d.name
            ));
        }
        if d.paused && waiting > 0 {
            warnings.push(format!(
                "destination {} is paused with {waiting} events waiting (`outbox-relay resume --destination {}`)",
                d.name, d.name
            ));
        }
    }
    warnings
}

/// `d` as a person reads it: to the second below an hour, to the minute below a day, to the hour
/// beyond.
pub(crate) fn rounded(d: Duration) -> String {
    let secs = d.as_secs();
    let unit = match secs {
        0..3600 => 1,
        3600..86_400 => 60,
        _ => 3600,
    };
    humantime::format_duration(Duration::from_secs(secs / unit * unit)).to_string()
}

/// A ready event waiting this long makes a warning.
const LAG_WARNING: Duration = Duration::from_secs(60);

/// The page, with the look-up's results when one was asked for and the last action's message.
pub(crate) async fn page(console: &Console, lookup: Option<&str>, done: Option<&str>) -> String {
    let mut html = String::with_capacity(16 * 1024);
    html.push_str(HEAD);
    let _ = write!(
        html,
        "<body data-relay=\"{}\"><header><h1>outbox-relay</h1><span>{}</span></header>\n<main>\n",
        console.has_relay,
        escape(&console.outbox.url().to_string())
    );
    if let Some(done) = done {
        let _ = writeln!(html, "<p class=\"done\" role=\"status\">{}</p>", escape(done));
    }
    // The count of dead letters, from the summary's one count of the queue.
    let mut dead_letters = None;
    match summary(console).await {
        Ok(summary) => {
            dead_letters = Some(summary.stats.dead_letters);
            render_summary(&mut html, console, &summary)
        }
        Err(e) => {
            let _ = writeln!(
                html,
                "<p class=\"warn\" id=\"db-error\">The database does not answer: {}</p>",
                escape(&e.to_string())
            );
        }
    }
    if console.has_relay {
        html.push_str("<section><h2>Commit to delivery</h2><canvas id=\"latency\" width=\"720\" height=\"160\" aria-label=\"latency chart\"></canvas><p class=\"legend\"><span class=\"p50\">p50</span> and <span class=\"p99\">p99</span> of recent deliveries (ms) over the last ten minutes, sampled every 2 s; <span id=\"rate\">-</span> events/s now</p></section>\n");
    }
    render_lookup(&mut html, console, lookup).await;
    match console.outbox.dead_letters(DEAD_LETTERS_SHOWN).await {
        Ok(letters) => {
            let total = dead_letters.unwrap_or(letters.len() as i64).max(letters.len() as i64);
            render_dead_letters(&mut html, console, &letters, total)
        }
        Err(e) => {
            let _ = writeln!(html, "<p class=\"warn\">Cannot list the dead letters: {}</p>", escape(&e.to_string()));
        }
    }
    html.push_str("</main>\n<script>");
    html.push_str(include_str!("console.js"));
    html.push_str("</script>\n</body></html>\n");
    html
}

fn render_summary(html: &mut String, console: &Console, s: &Summary) {
    let age =
        |age: Option<Duration>| age.map_or_else(|| "-".to_string(), |age| humantime::format_duration(age).to_string());
    let breaker = match &s.relay {
        None => "no relay in this process".to_string(),
        Some(r) if r.breaker_open => "OPEN: destination down, probing".to_string(),
        Some(_) => "closed".to_string(),
    };
    let limit = s.relay.as_ref().map_or_else(
        || "no relay in this process".to_string(),
        |r| format!("{} ({} in flight)", r.delivery_limit, r.deliveries_in_flight),
    );
    let paused = if s.pauses.is_empty() {
        "none".to_string()
    } else {
        s.pauses
            .iter()
            .map(|p| {
                let topic = p.topic.as_deref().unwrap_or("every topic");
                p.destination.as_deref().map_or(topic.to_string(), |d| format!("{topic} at {d}"))
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    html.push_str("<section><h2>The queue</h2><dl class=\"stats\">\n");
    for (id, label, value) in [
        ("pending", "pending (ready)", s.stats.pending.to_string()),
        ("held_by_key", "held by key", s.stats.held_by_key.to_string()),
        ("delayed", "delayed", s.stats.delayed.to_string()),
        ("in_flight", "in flight", s.stats.in_flight.to_string()),
        ("dead_letters", "dead letters", s.stats.dead_letters.to_string()),
        ("oldest_pending", "oldest pending", age(s.stats.oldest_pending_age)),
        ("breaker", "breaker", breaker),
        ("limit", "concurrency limit", limit),
        ("paused", "paused", paused),
    ] {
        let _ = writeln!(html, "<div><dt>{label}</dt><dd id=\"{id}\">{}</dd></div>", escape(&value));
    }
    html.push_str("</dl>\n");
    if !s.destinations.is_empty() {
        html.push_str("<table id=\"destinations\"><thead><tr><th>destination</th><th>pattern</th><th>new</th><th>parked</th><th>dead</th><th>relays</th><th>breaker</th><th>limit</th><th>delivered here</th></tr></thead><tbody>\n");
        for d in &s.destinations {
            let (breaker, limit, delivered) = match &d.relay {
                Some(r) => (
                    if r.breaker_open { "OPEN" } else { "closed" }.to_string(),
                    format!("{} ({} in flight)", r.delivery_limit, r.deliveries_in_flight),
                    r.delivered.to_string(),
                ),
                None => ("-".to_string(), "-".to_string(), "-".to_string()),
            };
            let paused = if d.stats.paused { " (paused)" } else { "" };
            let _ = writeln!(
                html,
                "<tr><td>{}{paused}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                escape(&d.stats.name),
                escape(&d.stats.pattern),
                d.stats.new,
                d.stats.due + d.stats.delayed + d.stats.in_flight,
                d.stats.dead_letters,
                d.stats.relays,
                escape(&breaker),
                escape(&limit),
                escape(&delivered)
            );
        }
        html.push_str("</tbody></table>\n");
    }
    let _ = writeln!(
        html,
        "<p class=\"health\">oldest open transaction {} · xmin horizon age {} · outbox dead tuples {} · notification queue {:.2}%</p>",
        age(s.health.oldest_transaction_age),
        s.health.xmin_horizon_age.map_or("-".into(), |a| a.to_string()),
        s.health.outbox_dead_tuples,
        s.health.notification_queue_usage * 100.0
    );
    html.push_str("<ul id=\"warnings\">");
    for warning in &s.warnings {
        let _ = write!(html, "<li class=\"warn\">{}</li>", escape(warning));
    }
    html.push_str("</ul>\n");
    // Pause and resume: every topic, or one.
    html.push_str("<div class=\"actions\">");
    form(html, console, "pause", &[("all", "1")], "Pause every topic");
    form(html, console, "resume", &[("all", "1")], "Lift the pause of every topic");
    html.push_str("</div><div class=\"actions\">");
    let _ = write!(
        html,
        "<form method=\"post\" action=\"/actions/pause\">{}<input name=\"topic\" placeholder=\"topic\" required maxlength=\"255\"> <button>Pause topic</button> <button formaction=\"/actions/resume\">Resume topic</button></form>",
        hidden(console)
    );
    html.push_str("</div></section>\n");
}

async fn render_lookup(html: &mut String, console: &Console, lookup: Option<&str>) {
    let shown = lookup.unwrap_or("");
    let _ = writeln!(
        html,
        "<section><h2>Look up an event</h2><form method=\"get\" action=\"/\"><input name=\"lookup\" placeholder=\"event id or key\" value=\"{}\"> <button>Look up</button></form>",
        escape(shown)
    );
    let Some(lookup) = lookup.filter(|l| !l.is_empty()) else {
        html.push_str("</section>\n");
        return;
    };
    // A number is an id (and maybe a key too); the key is taken as typed, spaces and all.
    let id = lookup.trim().parse::<i64>().ok();
    match console.outbox.look_up(id, Some(lookup), LOOKUP_SHOWN).await {
        Ok(found) if found.is_empty() => {
            let shown = escape(&format!("{lookup:?}"));
            let _ = writeln!(html, "<p id=\"lookup-result\">No event has the id or key {shown}.</p>");
        }
        Ok(found) => {
            if found.len() as i64 == LOOKUP_SHOWN {
                let _ = writeln!(
                    html,
                    "<p class=\"warn\">The event with that id, if any, and the newest with that key: {LOOKUP_SHOWN} in all; there may be more.</p>"
                );
            }
            render_found(html, &found)
        }
        Err(e) => {
            let _ = writeln!(html, "<p class=\"warn\">The look-up failed: {}</p>", escape(&e.to_string()));
        }
    }
    html.push_str("</section>\n");
}

fn render_found(html: &mut String, found: &[FoundEvent]) {
    html.push_str("<table id=\"lookup-result\"><tr><th>id</th><th>state</th><th>topic</th><th>key</th><th>attempts</th><th>created</th><th>last error</th><th>payload</th></tr>\n");
    for e in found {
        let _ = writeln!(
            html,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td><details><summary>show</summary><pre>{}</pre></details></td></tr>",
            e.id,
            escape(e.state.as_str()),
            escape(&e.topic),
            escape(e.key.as_deref().unwrap_or("")),
            e.attempts,
            pg_outbox_relay::rfc3339(e.created_at),
            escape(e.last_error.as_deref().unwrap_or("")),
            escape(e.payload.get())
        );
    }
    html.push_str("</table>\n");
}

fn render_dead_letters(html: &mut String, console: &Console, letters: &[DeadLetter], total: i64) {
    html.push_str("<section><h2>Dead letters</h2>\n");
    if letters.is_empty() {
        html.push_str("<p id=\"no-dead-letters\">No dead letters.</p></section>\n");
        return;
    }
    if total > letters.len() as i64 {
        let _ = writeln!(
            html,
            "<p class=\"warn\" id=\"dead-letters-shown\">The oldest {} of {total} dead letters (<code>outbox-relay dead-letters list --limit N</code> lists more); Retry all and Purge all act on all {total}.</p>",
            letters.len()
        );
    }
    html.push_str("<div class=\"actions\">");
    form(html, console, "retry", &[("all", "1")], &format!("Retry all {total}"));
    form(html, console, "purge", &[("all", "1")], &format!("Purge all {total}"));
    html.push_str("</div>\n<table id=\"dead-letters\"><tr><th>id</th><th>topic</th><th>key</th><th>attempts</th><th>failed</th><th>last error</th><th>payload</th><th></th></tr>\n");
    for d in letters {
        let id = d.id.to_string();
        let _ = write!(
            html,
            "<tr id=\"dead-{id}\"><td>{id}</td><td>{}</td><td>{}</td><td>{}</td><td>{}</td><td class=\"error\">{}</td><td><details data-event=\"{id}\"><summary>show</summary><pre></pre></details></td><td>",
            escape(&d.topic),
            escape(d.key.as_deref().unwrap_or("")),
            d.attempts,
            pg_outbox_relay::rfc3339(d.failed_at),
            escape(&d.last_error.chars().take(500).collect::<String>()),
        );
        form(html, console, "retry", &[("id", &id)], "Retry");
        form(html, console, "purge", &[("id", &id)], "Purge");
        html.push_str("</td></tr>\n");
    }
    html.push_str("</table></section>\n");
}

/// A one-button form that POSTs `action` with the CSRF token and these fields.
fn form(html: &mut String, console: &Console, action: &str, fields: &[(&str, &str)], label: &str) {
    let _ = write!(html, "<form method=\"post\" action=\"/actions/{action}\">{}", hidden(console));
    for (name, value) in fields {
        let _ = write!(html, "<input type=\"hidden\" name=\"{name}\" value=\"{}\">", escape(value));
    }
    let confirm = if action == "purge" { " data-confirm=\"Delete for good?\"" } else { "" };
    let _ = write!(html, "<button name=\"do\" value=\"{action}\"{confirm}>{}</button></form>", escape(label));
}

fn hidden(console: &Console) -> String {
    format!("<input type=\"hidden\" name=\"csrf\" value=\"{}\">", console.csrf)
}

/// The login form of a console that has a token.
pub(crate) fn login_page(message: Option<&str>) -> String {
    let mut html = String::from(HEAD);
    html.push_str("<body><header><h1>outbox-relay</h1></header>\n<main><section><h2>Log in</h2>");
    if let Some(message) = message {
        let _ = write!(html, "<p class=\"warn\" role=\"alert\">{}</p>", escape(message));
    }
    html.push_str("<form method=\"post\" action=\"/login\"><label>Access token (<code>--http-token</code>) <input type=\"password\" name=\"token\" autocomplete=\"current-password\" required></label> <button>Log in</button></form></section></main></body></html>\n");
    html
}

/// Text for HTML, in elements and in quoted attributes.
fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

const HEAD: &str = r#"<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="viewport" content="width=device-width, initial-scale=1">
<title>outbox-relay console</title>
<style>
body { font: 14px/1.4 system-ui, sans-serif; margin: 0; color: #1d232a; background: #f6f7f9; }
header { background: #1d232a; color: #fff; padding: .6em 1.2em; display: flex; gap: 1em; align-items: baseline; }
header h1 { font-size: 1.2em; margin: 0; } header span { opacity: .7; font-family: monospace; }
main { padding: 0 1.2em 2em; max-width: 1100px; }
section { background: #fff; border: 1px solid #dde1e6; border-radius: 6px; padding: .4em 1em 1em; margin-top: 1em; }
h2 { font-size: 1.05em; }
dl.stats { display: flex; flex-wrap: wrap; gap: .6em 2em; margin: 0; }
dl.stats dt { color: #5b6570; font-size: .85em; } dl.stats dd { margin: 0; font-size: 1.3em; font-weight: 600; }
table { border-collapse: collapse; width: 100%; } th, td { text-align: left; padding: .3em .5em; border-bottom: 1px solid #eceff2; vertical-align: top; }
td.error { max-width: 28em; overflow-wrap: anywhere; } pre { white-space: pre-wrap; max-width: 30em; margin: .3em 0; }
form { display: inline; } .actions { margin: .6em 0; display: flex; gap: .5em; flex-wrap: wrap; }
button { cursor: pointer; } .warn { color: #a4161a; } .done { background: #e6f4ea; padding: .5em 1em; border-radius: 4px; }
.health { color: #5b6570; } .legend .p50 { color: #1a73e8; } .legend .p99 { color: #d93025; }
</style></head>
"#;

#[cfg(test)]
mod tests {
    use super::escape;

    #[test]
    fn escapes_what_html_would_read() {
        assert_eq!(escape(r#"<a href="x">'&'</a>"#), "&lt;a href=&quot;x&quot;&gt;&#39;&amp;&#39;&lt;/a&gt;");
    }
}

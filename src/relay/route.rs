//! Routes: which events go to which destination.
//!
//! A relay delivers each event to every destination whose topic pattern ([`TopicPattern`])
//! matches the event's topic.
//!
//! Each destination is delivered to on its own: its own position over the new events, its own
//! parked events (retries, delays, events behind their key), its own concurrency limit, rate
//! limit, outage breaker and pause. A down destination holds back only its own events; an event
//! routed to several destinations is done with once every one of them has it (or has put it in its
//! dead letters). An event that no registered destination's pattern matches goes to the dead
//! letters (destination `''`), saying so: it is never dropped silently.

use std::fmt;

use crate::destination::{MAX_DESTINATION_LEN, validate_destination_name};
use crate::error::{Error, Result};
use crate::relay::Handler;

/// The name a relay built with [`Relay::new`](crate::Relay::new) delivers to: one destination,
/// every topic.
pub const DEFAULT_DESTINATION: &str = "default";

/// A topic pattern, in the AMQP grammar: a topic is split into words on `.`; in a pattern, `*`
/// stands for exactly one word and `#` for zero or more words; any other word must equal the
/// topic's word. So `order.*` matches `order.placed` but neither `order` nor `order.placed.eu`;
/// `order.#` matches all three; `#.failed` matches `mail.failed` and `failed`; `#` matches every
/// topic.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct TopicPattern {
    text: String,
    words: Vec<Word>,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Word {
    Exact(String),
    One,
    Any,
}

impl TopicPattern {
    /// Parses `pattern`, refusing an empty word (`order..placed`, a leading or trailing `.`), a
    /// `*` or `#` inside a word (`order.pl*`), and characters a topic cannot have.
    pub fn parse(pattern: &str) -> Result<TopicPattern> {
        let refuse = |why: String| Err(Error::config(format!("topic pattern {pattern:?}: {why}")));
        if pattern.is_empty() {
            return refuse("it is empty; `#` matches every topic".into());
        }
        if pattern.chars().count() > MAX_DESTINATION_LEN {
            return refuse(format!("it is longer than {MAX_DESTINATION_LEN} characters"));
        }
        let mut words = Vec::new();
        for (n, word) in pattern.split('.').enumerate() {
            words.push(match word {
                "" => return refuse(format!("word {} is empty (two dots in a row, or a dot at an end)", n + 1)),
                "*" => Word::One,
                "#" => Word::Any,
                _ if word.contains(['*', '#']) => {
                    return refuse(format!("word {word:?} has * or # in it: they stand alone between dots"));
                }
                _ => match word.chars().find(|c| !(c.is_ascii_alphanumeric() || matches!(c, '_' | ':' | '/' | '-'))) {
                    Some(c) => {
                        return refuse(format!(
                            "{c:?} cannot be in a topic (letters, digits and . _ - : / only); * and # stand alone"
                        ));
                    }
                    None => Word::Exact(word.to_string()),
                },
            });
        }
        Ok(TopicPattern { text: pattern.to_string(), words })
    }

    /// Whether `topic` matches.
    pub fn matches(&self, topic: &str) -> bool {
        let topic: Vec<&str> = topic.split('.').collect();
        matches_words(&self.words, &topic)
    }

    /// The pattern as written.
    pub fn as_str(&self) -> &str {
        &self.text
    }

    /// Whether it matches every topic (`#`, or `#.#`).
    pub fn matches_all(&self) -> bool {
        self.words.iter().all(|w| *w == Word::Any)
    }

    /// The pattern as a POSIX regular expression over `'.' || topic` (each word with the dot
    /// before it, so that `#` can stand for no word at all); `None` when it matches every topic.
    pub(crate) fn dotted_regex(&self) -> Option<String> {
        if self.matches_all() {
            return None;
        }
        let mut regex = String::from("^");
        for word in &self.words {
            match word {
                Word::Exact(text) => {
                    regex.push_str("\\.");
                    // Topic characters are literal in a regular expression, but for safety
                    // anything else is escaped.
                    for c in text.chars() {
                        if !c.is_ascii_alphanumeric() {
                            regex.push('\\');
                        }
                        regex.push(c);
                    }
                }
                Word::One => regex.push_str("\\.[^.]+"),
                Word::Any => regex.push_str("(\\.[^.]+)*"),
            }
        }
        regex.push('$');
        Some(regex)
    }
}

fn matches_words(pattern: &[Word], topic: &[&str]) -> bool {
    match pattern.split_first() {
        None => topic.is_empty(),
        Some((Word::Any, rest)) => (0..=topic.len()).any(|skip| matches_words(rest, &topic[skip..])),
        Some((word, rest)) => match topic.split_first() {
            None => false,
            Some((first, topic)) => {
                let fits = match word {
                    Word::Exact(text) => text == first,
                    _ => !first.is_empty(),
                };
                fits && matches_words(rest, topic)
            }
        },
    }
}

impl fmt::Display for TopicPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.text)
    }
}

impl fmt::Debug for TopicPattern {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "TopicPattern({:?})", self.text)
    }
}

impl std::str::FromStr for TopicPattern {
    type Err = Error;

    fn from_str(text: &str) -> Result<Self> {
        TopicPattern::parse(text)
    }
}

/// One destination of a relay: a name (for `status`, metrics, pauses and dead letters), the
/// topic pattern of the events it takes, the handler that delivers them, and the delivery
/// settings that may differ from the relay's.
///
/// ```
/// use pg_outbox_relay::{Event, Route, handler_fn};
/// let mailer = handler_fn(|event: Event| async move {
///     println!("mail {}", event.payload);
///     Ok(())
/// });
/// let route = Route::new("mailer", "mail.#", mailer)?.concurrency(8).rate_limit(Some(50.0));
/// # Ok::<(), pg_outbox_relay::Error>(())
/// ```
#[must_use]
pub struct Route<H> {
    pub(crate) name: String,
    pub(crate) pattern: TopicPattern,
    pub(crate) handler: H,
    pub(crate) concurrency: Option<usize>,
    pub(crate) fixed_concurrency: Option<bool>,
    pub(crate) rate_limit: Option<Option<f64>>,
}

impl<H: Handler> Route<H> {
    /// A destination named `name` for the events whose topic `pattern` matches; both are
    /// checked here.
    pub fn new(name: impl Into<String>, pattern: &str, handler: H) -> Result<Route<H>> {
        let name = name.into();
        validate_destination_name(&name)?;
        let pattern = TopicPattern::parse(pattern)?;
        Ok(Route { name, pattern, handler, concurrency: None, fixed_concurrency: None, rate_limit: None })
    }

    /// The ceiling of this destination's concurrency limit (or the limit itself, with
    /// [`fixed_concurrency`](Self::fixed_concurrency)). Defaults to
    /// [`RelayConfig::concurrency`](crate::RelayConfig::concurrency).
    pub fn concurrency(mut self, concurrency: usize) -> Self {
        self.concurrency = Some(concurrency);
        self
    }

    /// Keeps this destination's concurrency limit fixed at its ceiling. Defaults to
    /// [`RelayConfig::fixed_concurrency`](crate::RelayConfig::fixed_concurrency).
    pub fn fixed_concurrency(mut self, fixed: bool) -> Self {
        self.fixed_concurrency = Some(fixed);
        self
    }

    /// At most this many events a second to this destination (`None`: no limit). Defaults to
    /// [`RelayConfig::rate_limit`](crate::RelayConfig::rate_limit).
    pub fn rate_limit(mut self, per_second: Option<f64>) -> Self {
        self.rate_limit = Some(per_second);
        self
    }

    /// Its name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Its topic pattern.
    pub fn pattern(&self) -> &TopicPattern {
        &self.pattern
    }

    /// The relay's configuration with this destination's own settings.
    pub(crate) fn config(&self, relay: &crate::RelayConfig) -> crate::RelayConfig {
        let mut config = relay.clone();
        if let Some(concurrency) = self.concurrency {
            config.concurrency = concurrency;
        }
        if let Some(fixed) = self.fixed_concurrency {
            config.fixed_concurrency = fixed;
        }
        if let Some(rate) = self.rate_limit {
            config.rate_limit = rate;
        }
        config
    }
}

impl<H> fmt::Debug for Route<H> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Route")
            .field("name", &self.name)
            .field("pattern", &self.pattern)
            .field("concurrency", &self.concurrency)
            .field("fixed_concurrency", &self.fixed_concurrency)
            .field("rate_limit", &self.rate_limit)
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn patterns_match_as_amqp_topics_do() {
        let cases: &[(&str, &str, bool)] = &[
            ("order.*", "order.placed", true),
            ("order.*", "order", false),
            ("order.*", "order.placed.eu", false),
            ("order.#", "order", true),
            ("order.#", "order.placed", true),
            ("order.#", "order.placed.eu", true),
            ("order.#", "orders.placed", false),
            ("#.failed", "failed", true),
            ("#.failed", "mail.failed", true),
            ("#.failed", "mail.failed.twice", false),
            ("a.#.b", "a.b", true),
            ("a.#.b", "a.x.y.b", true),
            ("a.#.b", "a.x.y.c", false),
            ("*.*", "a.b", true),
            ("*.*", "a", false),
            ("#", "anything.at.all", true),
            ("mail.send", "mail.send", true),
            ("mail.send", "mail.sent", false),
            ("#.#", "x", true),
            ("*", "order:placed/v1-x_y", true),
        ];
        for (pattern, topic, expected) in cases {
            let p = TopicPattern::parse(pattern).unwrap();
            assert_eq!(p.matches(topic), *expected, "{pattern} against {topic}");
        }
    }

    #[test]
    fn bad_patterns_are_refused_with_the_reason() {
        for (pattern, reason) in [
            ("", "empty"),
            ("order..placed", "word 2 is empty"),
            (".order", "word 1 is empty"),
            ("order.", "word 2 is empty"),
            ("order.pl*", "stand alone"),
            ("order.#x", "stand alone"),
            ("order placed", "cannot be in a topic"),
            ("order.é", "cannot be in a topic"),
        ] {
            let e = TopicPattern::parse(pattern).unwrap_err().to_string();
            assert!(e.contains(reason), "{pattern:?}: {e}");
        }
        assert!(TopicPattern::parse(&"a".repeat(256)).unwrap_err().to_string().contains("longer than 255"));
    }

    #[test]
    fn regexes_are_anchored_and_match_all_is_none() {
        assert_eq!(TopicPattern::parse("#").unwrap().dotted_regex(), None);
        assert_eq!(TopicPattern::parse("order.*").unwrap().dotted_regex().unwrap(), "^\\.order\\.[^.]+$");
        assert_eq!(TopicPattern::parse("a-b.#").unwrap().dotted_regex().unwrap(), "^\\.a\\-b(\\.[^.]+)*$");
    }

    #[test]
    fn destination_names_are_checked() {}
}

#[cfg(test)]
mod in_postgres {
    use super::TopicPattern;

    /// The claims match patterns in SQL, with `('.' || topic) ~ regex`: PostgreSQL's regular
    /// expressions must say what `matches` says, for every pattern shape.
    #[tokio::test]
    async fn the_regular_expressions_match_in_postgresql_as_the_patterns_do() {
        let db = pg_outbox_relay_testkit::harness::TestDb::new().await;
        let client = db.client().await;
        let patterns = ["#", "order.*", "order.#", "#.failed", "a.#.b", "*.*", "*", "a-b:c/d_e.#", "#.#", "x.#.#.y"];
        let topics = [
            "order",
            "order.placed",
            "order.placed.eu",
            "orders.placed",
            "failed",
            "mail.failed",
            "a.b",
            "a.x.y.b",
            "a.x.y.c",
            "x",
            "a-b:c/d_e",
            "a-b:c/d_e.z",
            "aXb:c/d_e",
            "x.y",
            "x.q.y",
            "x.q.r.y",
        ];
        for pattern in patterns {
            let p = TopicPattern::parse(pattern).unwrap();
            for topic in topics {
                let in_sql: bool = client
                    .query_one("select $1::text is null or ('.' || $2::text) ~ $1::text", &[&p.dotted_regex(), &topic])
                    .await
                    .unwrap()
                    .get(0);
                assert_eq!(in_sql, p.matches(topic), "{pattern} against {topic}: regex {:?}", p.dotted_regex());
            }
        }
    }
}

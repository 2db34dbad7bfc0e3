//! Which dead letters an operator's listing, retry or purge takes.

use std::time::{Duration, SystemTime};

use crate::error::{Error, Result};
use crate::relay::TopicPattern;

/// Which dead letters to list, count, retry or purge: those every given condition holds for
/// (none given: every dead letter). Built with its methods:
///
/// ```
/// # use pg_outbox_relay::{DeadLetterFilter, TopicPattern};
/// let filter = DeadLetterFilter::default()
///     .destination("erp")
///     .topic(TopicPattern::parse("order.*").unwrap())
///     .error("timed out");
/// ```
#[derive(Clone, Debug, Default, PartialEq)]
#[non_exhaustive]
pub struct DeadLetterFilter {
    /// Dead at this destination (`""`: the events no destination's pattern matched).
    pub destination: Option<String>,
    /// Of a topic this pattern matches.
    pub topic: Option<TopicPattern>,
    /// Moved to the dead letters at this moment or later.
    pub failed_since: Option<SystemTime>,
    /// Moved to the dead letters before this moment.
    pub failed_before: Option<SystemTime>,
    /// Moved to the dead letters longer ago than this, by the database's clock.
    pub failed_longer_ago: Option<Duration>,
    /// Whose last error contains this text, in any case.
    pub error: Option<String>,
}

impl DeadLetterFilter {
    /// Only the dead letters of this destination.
    pub fn destination(mut self, name: impl Into<String>) -> Self {
        self.destination = Some(name.into());
        self
    }

    /// Only those of a topic `pattern` matches.
    pub fn topic(mut self, pattern: TopicPattern) -> Self {
        self.topic = Some(pattern);
        self
    }

    /// Only those that failed at `moment` or later.
    pub fn failed_since(mut self, moment: SystemTime) -> Self {
        self.failed_since = Some(moment);
        self
    }

    /// Only those that failed before `moment`.
    pub fn failed_before(mut self, moment: SystemTime) -> Self {
        self.failed_before = Some(moment);
        self
    }

    /// Only those that failed longer ago than `age`, by the database's clock (not this
    /// machine's, as [`DeadLetterFilter::failed_before`] is).
    pub fn failed_longer_ago(mut self, age: Duration) -> Self {
        self.failed_longer_ago = Some(age);
        self
    }

    /// Only those whose last error contains `text` (in any case).
    pub fn error(mut self, text: impl Into<String>) -> Self {
        self.error = Some(text.into());
        self
    }

    /// Whether it takes every dead letter.
    pub fn is_everything(&self) -> bool {
        *self == DeadLetterFilter::default()
    }

    /// An [`ErrorKind::InvalidInput`](crate::ErrorKind) error when it can take none by
    /// construction (an empty error text, a range that ends before it starts): an operator's
    /// mistake rather than a question. Every operation that takes a filter checks it first.
    pub fn check(&self) -> Result<()> {
        if self.error.as_deref() == Some("") {
            return Err(Error::invalid_input("the error text to match is empty (leave it out to take every error)"));
        }
        if let (Some(since), Some(before)) = (self.failed_since, self.failed_before)
            && before <= since
        {
            return Err(Error::invalid_input(format!(
                "the dead letters' failed since ({}) must be before their failed before ({})",
                humantime::format_rfc3339_seconds(since),
                humantime::format_rfc3339_seconds(before)
            )));
        }
        Ok(())
    }
}

//! The Kafka topic of an event.

use crate::error::{Error, Result};
use crate::relay::DeliveryError;

/// The longest Kafka topic name.
const MAX_TOPIC_NAME: usize = 249;

/// The Kafka topic of an event: a template where `{topic}` stands for the event's topic.
#[derive(Debug, Clone)]
pub(super) struct TopicTemplate {
    pub(super) text: String,
}

impl TopicTemplate {
    pub(super) fn parse(text: &str) -> Result<Self> {
        let rest = text.replacen("{topic}", "", 1);
        if rest.contains(['{', '}']) {
            return Err(Error::config(format!(
                "invalid Kafka topic template {text:?}: {{topic}} once at most, and no other braces"
            )));
        }
        let template = TopicTemplate { text: text.to_string() };
        let sample = if text.contains("{topic}") { template.fill("t") } else { text.to_string() };
        if !valid_topic_name(&sample) {
            return Err(Error::config(format!(
                "invalid Kafka topic template {text:?}: Kafka topics are 1 to {MAX_TOPIC_NAME} letters, digits, '.', '_' and '-'"
            )));
        }
        Ok(template)
    }

    fn fill(&self, topic: &str) -> String {
        self.text.replacen("{topic}", topic, 1)
    }

    /// The Kafka topic of an event of `topic`; one Kafka cannot take is the event's failure.
    pub(super) fn render(&self, topic: &str) -> Result<String, DeliveryError> {
        let name = self.fill(topic);
        if valid_topic_name(&name) {
            Ok(name)
        } else {
            Err(DeliveryError::permanent(format!(
                "the event's topic {topic:?} makes the Kafka topic {name:?}, which Kafka does not take (1 to {MAX_TOPIC_NAME} letters, digits, '.', '_' and '-')"
            )))
        }
    }
}

fn valid_topic_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= MAX_TOPIC_NAME
        && name != "."
        && name != ".."
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-'))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn topic_templates() {
        assert_eq!(TopicTemplate::parse("{topic}").unwrap().render("order.placed").unwrap(), "order.placed");
        assert_eq!(TopicTemplate::parse("outbox.{topic}").unwrap().render("a").unwrap(), "outbox.a");
        assert_eq!(TopicTemplate::parse("events").unwrap().render("a").unwrap(), "events");
        for bad in ["", "{topic}{topic}", "{x}", "a b.{topic}", "ä{topic}", "..", &"x".repeat(250)] {
            assert!(TopicTemplate::parse(bad).is_err(), "{bad}");
        }
        let refused = TopicTemplate::parse("{topic}").unwrap().render("order/placed").unwrap_err();
        assert!(refused.is_permanent());
    }
}

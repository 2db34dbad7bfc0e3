//! What receivers' libraries expect of a webhook: Standard Webhooks 1.0 signatures and the
//! CloudEvents 1.0 HTTP binding (binary and structured content modes).

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{KeyInit, Mac};

use super::HttpFormat;
use crate::error::{Error, Result};
use crate::event::Event;

/// The CloudEvents `source` of events when none is given.
pub const DEFAULT_CLOUDEVENTS_SOURCE: &str = "urn:outbox-relay";

/// A Standard Webhooks signing secret: `whsec_` and the base64 of the key (at least 16 bytes).
/// Its `Debug` shows nothing of it.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningSecret {
    key: Vec<u8>,
}

impl std::fmt::Debug for SigningSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("SigningSecret(..)")
    }
}

/// The shortest key taken (the specification asks for 24 to 64 random bytes).
const MIN_KEY_BYTES: usize = 16;

impl SigningSecret {
    /// Parses `whsec_<base64>`; the error never shows the secret.
    pub fn parse(text: &str) -> Result<Self> {
        let encoded = text.trim().strip_prefix("whsec_").ok_or_else(|| {
            Error::config("a signing secret must start with whsec_ (Standard Webhooks: whsec_ and the key in base64)")
        })?;
        let key =
            BASE64.decode(encoded).map_err(|_| Error::config("the signing secret after whsec_ is not valid base64"))?;
        if key.len() < MIN_KEY_BYTES {
            return Err(Error::config(format!(
                "the signing secret's key is {} bytes long; at least {MIN_KEY_BYTES} are needed (24 to 64 recommended)",
                key.len()
            )));
        }
        Ok(SigningSecret { key })
    }

    /// `v1,<base64 of HMAC-SHA256("{id}.{timestamp}.{body}")>`.
    fn sign(&self, id: &str, timestamp: u64, body: &[u8]) -> String {
        // A key of any length is valid for HMAC.
        let mut mac = hmac::Hmac::<sha2::Sha256>::new_from_slice(&self.key).expect("HMAC takes any key length");
        mac.update(id.as_bytes());
        mac.update(b".");
        mac.update(timestamp.to_string().as_bytes());
        mac.update(b".");
        mac.update(body);
        format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
    }
}

/// The `webhook-signature` header's value: one signature per secret, space-separated, so that
/// a receiver holding any of them verifies the request (secrets rotate without downtime).
pub(crate) fn signatures(secrets: &[SigningSecret], id: &str, timestamp: u64, body: &[u8]) -> String {
    secrets.iter().map(|s| s.sign(id, timestamp, body)).collect::<Vec<_>>().join(" ")
}

/// What goes into one request for an event.
pub(crate) struct RequestParts {
    pub(crate) body: Vec<u8>,
    pub(crate) content_type: &'static str,
    /// The CloudEvents attributes of binary mode.
    pub(crate) headers: Vec<(&'static str, String)>,
}

/// The body, its content type and (binary mode) the CloudEvents headers for `format`.
pub(crate) fn request_parts(
    event: &Event,
    format: HttpFormat,
    source: &str,
) -> std::result::Result<RequestParts, serde_json::Error> {
    let parts = |body, content_type, headers| RequestParts { body, content_type, headers };
    match format {
        HttpFormat::Raw => Ok(parts(serde_json::to_vec(event)?, "application/json", Vec::new())),
        HttpFormat::CloudEventsBinary => {
            let mut headers = vec![
                ("ce-specversion", "1.0".to_string()),
                ("ce-id", event.uuid.to_string()),
                ("ce-source", percent_encode(source)),
                ("ce-type", percent_encode(&event.topic)),
                ("ce-time", crate::timestamp::rfc3339_micros(event.created_at)),
            ];
            if let Some(key) = &event.key {
                headers.push(("ce-partitionkey", percent_encode(key)));
            }
            Ok(parts(event.payload.get().as_bytes().to_vec(), "application/json", headers))
        }
        HttpFormat::CloudEventsStructured => {
            let time = crate::timestamp::rfc3339_micros(event.created_at);
            let object = Structured {
                specversion: "1.0",
                id: event.uuid.to_string(),
                source,
                r#type: &event.topic,
                time,
                datacontenttype: "application/json",
                data: &event.payload,
                partitionkey: event.key.as_deref(),
            };
            Ok(parts(serde_json::to_vec(&object)?, "application/cloudevents+json; charset=utf-8", Vec::new()))
        }
    }
}

/// A CloudEvent in the structured mode's JSON, its `data` the payload's text as stored.
#[derive(serde::Serialize)]
struct Structured<'a> {
    specversion: &'static str,
    id: String,
    source: &'a str,
    r#type: &'a str,
    time: String,
    datacontenttype: &'static str,
    data: &'a crate::Payload,
    #[serde(skip_serializing_if = "Option::is_none")]
    partitionkey: Option<&'a str>,
}

/// Checks a CloudEvents source: a URI-reference, so non-empty and without spaces or controls.
pub(crate) fn check_source(source: &str) -> Result<()> {
    if source.is_empty() || source.chars().any(|c| c.is_whitespace() || c.is_control()) {
        return Err(Error::config(format!(
            "the CloudEvents source {source:?} is no URI-reference (e.g. urn:shop:orders or https://shop.example/orders)"
        )));
    }
    Ok(())
}

/// Percent-encodes what the CloudEvents HTTP binding does not allow in a header value: all but
/// printable ASCII, and space, `"` and `%`.
fn percent_encode(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for b in text.bytes() {
        if (0x21..0x7f).contains(&b) && b != b'"' && b != b'%' {
            out.push(b as char);
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_signature_is_the_specifications_example() {
        // The example of the Standard Webhooks specification (its README, "Signature scheme").
        let secret = SigningSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        let body = br#"{"test": 2432232314}"#;
        assert_eq!(
            signatures(&[secret], "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body),
            "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
        );
    }

    #[test]
    fn secrets_are_checked_and_never_shown() {
        for bad in ["MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw", "whsec_not base64!", "whsec_c2hvcnQ="] {
            let e = SigningSecret::parse(bad).unwrap_err().to_string();
            assert!(!e.contains("MfKQ9r8") && !e.contains("c2hvcnQ"), "{e}");
        }
        let secret = SigningSecret::parse("whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw").unwrap();
        assert_eq!(format!("{secret:?}"), "SigningSecret(..)");
    }

    #[test]
    fn header_values_are_percent_encoded_where_the_binding_says() {
        assert_eq!(percent_encode("order.placed"), "order.placed");
        assert_eq!(percent_encode("a b\"c%d"), "a%20b%22c%25d");
        assert_eq!(percent_encode("ç"), "%C3%A7");
    }
}

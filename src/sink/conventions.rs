//! What receivers' libraries expect of a webhook: Standard Webhooks 1.0 signatures and the
//! CloudEvents 1.0 HTTP binding (its headers; the attributes are in `cloudevents`).

use base64::Engine;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{KeyInit, Mac};

use super::EventFormat;
use super::cloudevents::{self, Parts};
use crate::error::{Error, Result};
use crate::event::Event;

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
    /// The CloudEvents attributes of binary mode, as `ce-*` headers, and the event's headers
    /// that go as HTTP headers.
    pub(crate) headers: Vec<(String, String)>,
}

/// The body, its content type and (binary mode) the CloudEvents headers for `format`, their
/// values percent-encoded as the HTTP binding says.
pub(crate) fn request_parts(
    event: &Event,
    format: EventFormat,
    source: &str,
) -> std::result::Result<RequestParts, serde_json::Error> {
    let Parts { body, content_type, attributes, headers } = cloudevents::parts(event, format, source)?;
    let headers = attributes
        .into_iter()
        .map(|(name, value)| (format!("ce-{name}"), percent_encode(&value)))
        .chain(headers.into_iter().map(|(name, value)| (name.to_string(), value.to_string())))
        .collect();
    Ok(RequestParts { body, content_type, headers })
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

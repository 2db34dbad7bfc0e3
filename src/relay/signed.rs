//! The signature of the notifications that carry events (migration 0018).
//!
//! Any role that may connect to the database may NOTIFY on the outbox channel: a notification's
//! events are delivered from it only when it carries the HMAC-SHA256 of its JSON under the key
//! the trigger signs with (`outbox_relay.notification_key`, made at random by the migration and
//! readable by the relay's role alone). Anything else on the channel is only a wake-up.

use hmac::{KeyInit, Mac};

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// Hex digits of the signature in front of a notification's JSON.
const SIGNATURE_HEX: usize = 64;

/// The key the trigger signs with, as the relay read it.
#[derive(Clone)]
pub(crate) struct NotificationKey(std::sync::Arc<[u8]>);

impl std::fmt::Debug for NotificationKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NotificationKey(..)")
    }
}

/// Why a notification's events cannot be taken from it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Unsigned {
    /// No signature: a wake-up (an empty payload, or a trigger that carries no events).
    Plain,
    /// A signature that does not match: another role sent it, or the key changed.
    Forged,
}

impl NotificationKey {
    pub(crate) fn new(key: Vec<u8>) -> NotificationKey {
        NotificationKey(key.into())
    }

    /// The JSON of a signed notification, once its signature is checked.
    pub(crate) fn verify<'a>(&self, payload: &'a str) -> Result<&'a str, Unsigned> {
        if payload.is_empty() {
            return Err(Unsigned::Plain);
        }
        let (Some(hex), Some(json)) = (payload.get(..SIGNATURE_HEX), payload.get(SIGNATURE_HEX..)) else {
            return Err(Unsigned::Forged);
        };
        let signature = decode_hex(hex).ok_or(Unsigned::Forged)?;
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(json.as_bytes());
        mac.verify_slice(&signature).map_err(|_| Unsigned::Forged)?;
        Ok(json)
    }

    /// The payload the trigger would send for `json` (for tests).
    #[cfg(test)]
    pub(crate) fn sign(&self, json: &str) -> String {
        let mut mac = HmacSha256::new_from_slice(&self.0).expect("HMAC takes any key length");
        mac.update(json.as_bytes());
        let signature: String = mac.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect();
        signature + json
    }
}

fn decode_hex(hex: &str) -> Option<Vec<u8>> {
    let digits = hex.as_bytes();
    digits
        .chunks(2)
        .map(|pair| std::str::from_utf8(pair).ok().and_then(|pair| u8::from_str_radix(pair, 16).ok()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_notification_signed_with_the_key_is_taken() {
        let key = NotificationKey::new(b"0123456789abcdef0123456789abcdef".to_vec());
        let json = r#"{"x":"7","e":[]}"#;
        let signed = key.sign(json);
        assert_eq!(key.verify(&signed), Ok(json));
        // RFC 4231's first test case, to pin the algorithm the trigger computes in SQL.
        let rfc = NotificationKey::new(vec![0x0b; 20]);
        assert_eq!(
            rfc.sign("Hi There").get(..64),
            Some("b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7")
        );
        assert_eq!(key.verify(""), Err(Unsigned::Plain));
        assert_eq!(key.verify(json), Err(Unsigned::Forged));
        let other = NotificationKey::new(b"another key".to_vec());
        assert_eq!(other.verify(&signed), Err(Unsigned::Forged));
        let tampered = signed.replace(r#""7""#, r#""8""#);
        assert_eq!(key.verify(&tampered), Err(Unsigned::Forged));
        assert_eq!(key.verify(&"é".repeat(40)), Err(Unsigned::Forged), "not on a character boundary");
        assert_eq!(key.verify(&"z".repeat(70)), Err(Unsigned::Forged));
    }
}

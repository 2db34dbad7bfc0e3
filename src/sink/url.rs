//! Sink URLs as they may be shown: no password, no query value (they may be tokens).

/// `url` with its password and every query value replaced by `***`, without a fragment.
pub(super) fn redact(url: &url::Url) -> String {
    let mut shown = url.clone();
    if shown.password().is_some() {
        let _cannot_fail_with_a_host = shown.set_password(Some("***"));
    }
    if shown.query().is_some() {
        let pairs: Vec<(String, String)> = url.query_pairs().map(|(k, _)| (k.into_owned(), "***".into())).collect();
        shown.query_pairs_mut().clear().extend_pairs(pairs);
    }
    shown.set_fragment(None);
    shown.to_string()
}

/// A sink URL as it may be shown, or a placeholder when it does not parse.
pub(super) fn describe(spec: &str) -> String {
    match url::Url::parse(spec) {
        Ok(url) => redact(&url),
        Err(_) => "(a sink URL that does not parse)".to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_and_query_values_are_hidden() {
        let url = url::Url::parse("https://user:s3cret@hooks.example/in?token=abc&x=1#frag").unwrap();
        assert_eq!(redact(&url), "https://user:***@hooks.example/in?token=***&x=***");
        assert_eq!(describe("nats://u:p@127.0.0.1:4222"), "nats://u:***@127.0.0.1:4222");
        assert_eq!(describe("http://u:p@"), "(a sink URL that does not parse)");
    }
}

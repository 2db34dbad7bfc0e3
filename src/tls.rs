//! TLS set-up shared by the HTTP sink (and any other rustls user in the process).

/// Installs rustls' ring provider as the process default, once; a provider installed earlier
/// (by the application) is kept.
pub(crate) fn install_crypto_provider() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let _already_installed = rustls::crypto::ring::default_provider().install_default();
    });
}

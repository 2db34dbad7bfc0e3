//! TLS to PostgreSQL (rustls), with libpq's `sslmode` semantics, and the HTTP sink's TLS
//! configuration; both with an explicit crypto provider.
//!
//! | `sslmode` | encrypted | server certificate checked |
//! |---|---|---|
//! | `disable` | no | - |
//! | `prefer` (tokio-postgres' default) | if the server offers TLS | no |
//! | `require` | yes | no (as libpq without a root certificate) |
//! | `verify-ca` | yes | chain to a trusted root |
//! | `verify-full` | yes | chain and host name |
//!
//! Trusted roots: the file named by `sslrootcert` (PEM), else the system's certificate store.

use std::path::Path;
use std::sync::Arc;

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{CertificateError, DigitallySignedStruct, Error as TlsError, RootCertStore, SignatureScheme};
use tokio_postgres_rustls::MakeRustlsConnect;

use crate::conninfo::Verify;
use crate::error::{Error, Result};

/// The TLS configuration of the HTTP sink: the system's trusted roots, ring as an explicit
/// provider (a library must not install a process-wide default), HTTP/2 and 1.1 offered.
#[cfg(feature = "http")]
pub(crate) fn https_client_config() -> Result<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut roots = RootCertStore::empty();
    for cert in rustls_native_certs::load_native_certs().certs {
        let _unusable_system_certificate_skipped = roots.add(cert);
    }
    let mut config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::config(format!("cannot set up TLS for the HTTP sink: {e}")))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(config)
}

/// The rustls connector for `verify`, trusting `root` (or the system's roots).
pub(crate) fn connector(verify: Verify, root: Option<&Path>) -> Result<MakeRustlsConnect> {
    // An explicit provider: a library must not install a process-wide default.
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| Error::config(format!("cannot set up TLS: {e}")))?;
    let config = match verify {
        Verify::None => {
            builder.dangerous().with_custom_certificate_verifier(Arc::new(AnyCertificate)).with_no_client_auth()
        }
        Verify::Chain | Verify::Full => {
            let roots = Arc::new(trusted_roots(root)?);
            let webpki = rustls::client::WebPkiServerVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| Error::config(format!("cannot build the TLS certificate verifier: {e}")))?;
            if verify == Verify::Full {
                builder.with_webpki_verifier(webpki).with_no_client_auth()
            } else {
                builder.dangerous().with_custom_certificate_verifier(Arc::new(ChainOnly(webpki))).with_no_client_auth()
            }
        }
    };
    Ok(MakeRustlsConnect::new(config))
}

fn trusted_roots(root: Option<&Path>) -> Result<RootCertStore> {
    let mut store = RootCertStore::empty();
    match root {
        Some(path) => {
            let certs = CertificateDer::pem_file_iter(path)
                .and_then(|certs| certs.collect::<std::result::Result<Vec<_>, _>>())
                .map_err(|e| Error::config(format!("cannot read sslrootcert {}: {e}", path.display())))?;
            if certs.is_empty() {
                return Err(Error::config(format!("sslrootcert {} holds no PEM certificate", path.display())));
            }
            for cert in certs {
                store
                    .add(cert)
                    .map_err(|e| Error::config(format!("sslrootcert {}: unusable certificate: {e}", path.display())))?;
            }
        }
        None => {
            let found = rustls_native_certs::load_native_certs();
            for cert in found.certs {
                let _unusable_system_certificate_skipped = store.add(cert);
            }
            if store.is_empty() {
                return Err(Error::config(
                    "sslmode verify-ca/verify-full needs trusted root certificates: none in the system store; pass sslrootcert=FILE",
                ));
            }
        }
    }
    Ok(store)
}

/// `require`: encryption without authentication, as libpq does without a root certificate.
#[derive(Debug)]
struct AnyCertificate;

impl ServerCertVerifier for AnyCertificate {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, TlsError> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, TlsError> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &signature_algorithms())
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, TlsError> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &signature_algorithms())
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        signature_algorithms().supported_schemes()
    }
}

/// The handshake signatures `require` still checks (the server must hold its certificate's key).
fn signature_algorithms() -> rustls::crypto::WebPkiSupportedAlgorithms {
    rustls::crypto::ring::default_provider().signature_verification_algorithms
}

/// `verify-ca`: the chain must lead to a trusted root; the host name is not checked.
#[derive(Debug)]
struct ChainOnly(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for ChainOnly {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> std::result::Result<ServerCertVerified, TlsError> {
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(TlsError::InvalidCertificate(
                CertificateError::NotValidForName | CertificateError::NotValidForNameContext { .. },
            )) => Ok(ServerCertVerified::assertion()),
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, TlsError> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> std::result::Result<HandshakeSignatureValid, TlsError> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

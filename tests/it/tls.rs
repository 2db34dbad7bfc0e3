//! TLS to PostgreSQL: `sslmode` require, verify-ca and verify-full against a server with a
//! certificate from a test CA (made with the openssl command, hence `needs_openssl`), and a
//! relay over TLS.

use std::path::Path;
use std::process::Command;

use pg_outbox_relay::{NewEvent, Outbox, RelayConfig};
use pg_outbox_relay_cluster::{EmbeddedOptions, EmbeddedPostgres};
use serde_json::json;

use crate::relay_support::{self as support, config, recorder};
use crate::tools;

fn openssl(dir: &Path, args: &[&str]) {
    let openssl = tools::program("openssl", "Debian: apt install openssl");
    let out = Command::new(openssl).current_dir(dir).args(args).output().expect("openssl runs");
    assert!(out.status.success(), "openssl {args:?}: {}", String::from_utf8_lossy(&out.stderr));
}

/// A CA, and a server certificate it signed for the host name `db.example` only.
fn make_certificates(dir: &Path) {
    openssl(
        dir,
        &[
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "ca.key",
            "-out",
            "ca.crt",
            "-days",
            "2",
            "-subj",
            "/CN=outbox-relay test CA",
        ],
    );
    openssl(
        dir,
        &[
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            "server.key",
            "-out",
            "server.csr",
            "-subj",
            "/CN=db.example",
        ],
    );
    std::fs::write(
        dir.join("server.ext"),
        "subjectAltName=DNS:db.example\nbasicConstraints=CA:FALSE\nkeyUsage=digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(
        dir,
        &[
            "x509",
            "-req",
            "-in",
            "server.csr",
            "-CA",
            "ca.crt",
            "-CAkey",
            "ca.key",
            "-CAcreateserial",
            "-out",
            "server.crt",
            "-days",
            "2",
            "-extfile",
            "server.ext",
        ],
    );
}

/// Copies the server's certificate and key into the data directory, owned by the server's user.
fn install(pg: &EmbeddedPostgres, certs: &Path) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let data = pg.data_dir();
    let owner = std::fs::metadata(data).unwrap();
    for file in ["server.crt", "server.key"] {
        let target = data.join(file);
        std::fs::copy(certs.join(file), &target).unwrap();
        std::fs::set_permissions(&target, std::fs::Permissions::from_mode(0o600)).unwrap();
        std::os::unix::fs::chown(&target, Some(owner.uid()), Some(owner.gid())).unwrap();
    }
}

async fn admin_for(pg: &EmbeddedPostgres) -> tokio_postgres::Client {
    pg.database_url().for_database("tls_test").connect().await.unwrap()
}

/// The test CA and the server certificate come from the openssl command.
mod needs_openssl {
    use super::*;

    #[tokio::test]
    async fn tls_modes_are_enforced_and_a_relay_works_over_tls() {
        let certs = tempfile::tempdir().unwrap();
        make_certificates(certs.path());
        // A private cluster: turning TLS on must not touch the shared test server.
        let pg =
            tokio::task::spawn_blocking(|| EmbeddedPostgres::start(EmbeddedOptions::default())).await.unwrap().unwrap();
        install(&pg, certs.path());
        let admin_url = pg.url();
        let admin = pg_outbox_relay::DatabaseUrl::parse(&admin_url).unwrap().connect().await.unwrap();
        admin.batch_execute("alter system set ssl = on").await.unwrap();
        admin.batch_execute("select pg_reload_conf()").await.unwrap();
        admin.batch_execute("create database tls_test").await.unwrap();

        let base = pg.database_url().for_database("tls_test").to_connection_string();
        let ca = certs.path().join("ca.crt");
        let ca = ca.display();
        let encrypted = |outbox: Outbox| async move {
            let client = outbox.connection().await.unwrap();
            let row = client.query_one("select ssl from pg_stat_ssl where pid = pg_backend_pid()", &[]).await.unwrap();
            row.get::<_, bool>(0)
        };

        // require: encrypted, certificate not checked
        let require = Outbox::connect(&format!("{base}?sslmode=require")).await.unwrap();
        assert!(encrypted(require.clone()).await);
        require.migrate().await.unwrap();
        // verify-ca: the chain is checked (the host name is not: the certificate is for db.example)
        let verify_ca = Outbox::connect(&format!("{base}?sslmode=verify-ca&sslrootcert={ca}")).await.unwrap();
        assert!(encrypted(verify_ca.clone()).await);
        // verify-full: the host name must match; 127.0.0.1 is not db.example
        let err = Outbox::connect(&format!("{base}?sslmode=verify-full&sslrootcert={ca}")).await.unwrap_err();
        assert!(err.is_connect(), "{err:?}");
        assert!(err.to_string().to_lowercase().contains("certificate"), "{err}");
        // verify-ca with an untrusted root (the system store does not know the test CA)
        let err = Outbox::connect(&format!("{base}?sslmode=verify-ca")).await.unwrap_err();
        assert!(err.to_string().to_lowercase().contains("certificate"), "{err}");
        // a missing root file is a configuration error naming it
        let err =
            Outbox::connect(&format!("{base}?sslmode=verify-full&sslrootcert=/nonexistent/ca.pem")).await.unwrap_err();
        assert!(err.to_string().contains("/nonexistent/ca.pem"), "{err}");
        // plain connections still work (the server accepts both)
        assert!(!encrypted(Outbox::connect(&format!("{base}?sslmode=disable")).await.unwrap()).await);

        // A relay over TLS: pool and listener.
        let (handler, mut deliveries) = recorder();
        let relay = support::start(&verify_ca, RelayConfig { ..config() }, handler);
        support::relay_waiting(&admin_for(&pg).await).await;
        let id = verify_ca.publish(&NewEvent::new("tls.works", json!({}))).await.unwrap();
        assert_eq!(deliveries.next().await.event.id, id);
        relay.stop().await;
        let listener_ssl: bool = admin_for(&pg)
            .await
            .query_one(
                "select bool_and(s.ssl) from pg_stat_ssl s join pg_stat_activity a using (pid)
              where a.datname = 'tls_test' and a.application_name like 'outbox-relay%'",
                &[],
            )
            .await
            .unwrap()
            .get::<_, Option<bool>>(0)
            .unwrap_or(true);
        assert!(listener_ssl);
        drop(pg);
    }
}

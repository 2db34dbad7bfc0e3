//! Installing without Rust (issue 44): the container image, built without a container engine or a
//! base image from Debian's packages, run from its own root filesystem; the Debian package,
//! installed with dpkg, run as its system user, purged; and docs/docker-compose.yml's services
//! run with what the file gives them.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

use crate::binary::BIN;

/// The repository's root.
fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn ran(what: &str, output: std::io::Result<Output>) -> String {
    let output = output.unwrap_or_else(|e| panic!("cannot run {what}: {e}"));
    assert!(
        output.status.success(),
        "{what} failed: {}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

/// Whether this process is root (chroot, dpkg -i and setpriv need it).
fn is_root() -> bool {
    ran("id -u", Command::new("id").arg("-u").output()).trim() == "0"
}

/// A test's events, published on `url`.
async fn publish(url: &str, n: i64) -> Vec<i64> {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls).await.unwrap();
    tokio::spawn(connection);
    let rows = client
        .query(
            "select outbox_relay.publish('order.placed', jsonb_build_object('n', g), 'order-' || g) from generate_series(1, $1::int8) g",
            &[&n],
        )
        .await
        .unwrap();
    rows.iter().map(|r| r.get(0)).collect()
}

type StdoutLines = tokio::io::Lines<tokio::io::BufReader<tokio::process::ChildStdout>>;

/// Starts `command` with its output piped (killed when dropped), and its stdout's lines.
fn started(mut command: tokio::process::Command) -> (tokio::process::Child, StdoutLines) {
    use tokio::io::AsyncBufReadExt;
    let mut child = command
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .unwrap();
    let out = tokio::io::BufReader::new(child.stdout.take().unwrap()).lines();
    (child, out)
}

/// Reads `lines` until every event of `ids` came by (as the stdout sink writes them).
async fn delivered(lines: &mut StdoutLines, ids: &[i64]) {
    let mut left: std::collections::HashSet<i64> = ids.iter().copied().collect();
    tokio::time::timeout(crate::relay_support::PATIENCE, async {
        while !left.is_empty() {
            let line = lines.next_line().await.unwrap().expect("the relay's output ended");
            if let Ok(event) = serde_json::from_str::<Value>(&line) {
                left.remove(&event["id"].as_i64().unwrap_or_default());
            }
        }
    })
    .await
    .unwrap_or_else(|_| panic!("not delivered: {left:?}"));
}

/// The tests that fetch Debian's packages (`apt-get download`) or install one (root, dpkg).
mod needs_debian {
    use super::*;
    use crate::binary::terminate_with_output;
    use crate::harness::TestDb;
    use tokio::io::AsyncBufReadExt;

    /// The image's archive is what an engine loads (every blob's digest and size as the index and
    /// manifest say; a non-root user and the relay as entrypoint, as the Dockerfile says), and its
    /// root filesystem runs the relay on its own: as uid 65532 in a chroot, against this test's
    /// database, delivering. Where a container engine runs, it loads the image and runs it too;
    /// where none can, the test says so.
    #[tokio::test]
    async fn the_container_image_is_made_of_debian_packages_and_runs_the_relay_as_non_root() {
        let dir = tempfile::tempdir().unwrap();
        let archive = dir.path().join("outbox-relay.oci.tar");
        let built = Command::new(root().join("packaging/image/build"))
            .args(["--binary", BIN, "--out", archive.to_str().unwrap(), "--tag", "outbox-relay:test"])
            .output();
        ran("packaging/image/build", built);
        let oci = dir.path().join("oci");
        std::fs::create_dir(&oci).unwrap();
        ran("tar", Command::new("tar").arg("-xf").arg(&archive).arg("-C").arg(&oci).output());
        let blob = |digest: &str| {
            let path = oci.join("blobs/sha256").join(digest.strip_prefix("sha256:").unwrap());
            let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{digest}: {e}"));
            let sum = ran("sha256sum", Command::new("sha256sum").arg(&path).output());
            assert_eq!(format!("sha256:{}", sum.split_whitespace().next().unwrap()), digest, "a blob's digest");
            bytes
        };
        let described = |json: &Value, blob_bytes: &[u8]| {
            assert_eq!(json["size"].as_u64().unwrap() as usize, blob_bytes.len(), "a blob's size: {json}");
        };
        let index: Value = serde_json::from_slice(&std::fs::read(oci.join("index.json")).unwrap()).unwrap();
        let entry = &index["manifests"][0];
        let manifest_bytes = blob(entry["digest"].as_str().unwrap());
        described(entry, &manifest_bytes);
        assert_eq!(entry["annotations"]["io.containerd.image.name"], "docker.io/library/outbox-relay:test");
        let manifest: Value = serde_json::from_slice(&manifest_bytes).unwrap();
        let config_bytes = blob(manifest["config"]["digest"].as_str().unwrap());
        described(&manifest["config"], &config_bytes);
        let layer = &manifest["layers"][0];
        let layer_bytes = blob(layer["digest"].as_str().unwrap());
        described(layer, &layer_bytes);
        assert!(layer_bytes.len() < 80 << 20, "a small image: {} bytes compressed", layer_bytes.len());
        let config: Value = serde_json::from_slice(&config_bytes).unwrap();
        let run = &config["config"];
        assert_eq!(run["User"], "65532:65532", "not root: {run}");
        assert_eq!(run["Entrypoint"], serde_json::json!(["/usr/bin/outbox-relay"]));
        // The Dockerfile, for engines that build from one, says the same.
        let dockerfile = std::fs::read_to_string(root().join("packaging/image/Dockerfile")).unwrap();
        let said = |instruction: &str| {
            dockerfile
                .lines()
                .find_map(|l| l.strip_prefix(instruction))
                .unwrap_or_else(|| panic!("{instruction}"))
                .trim()
        };
        assert_eq!(said("USER "), run["User"].as_str().unwrap());
        assert_eq!(serde_json::from_str::<Value>(said("ENTRYPOINT ")).unwrap(), run["Entrypoint"]);
        assert_eq!(serde_json::from_str::<Value>(said("CMD ")).unwrap(), run["Cmd"]);
        let env: Vec<&str> = run["Env"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        assert_eq!(said("ENV ").split_whitespace().collect::<Vec<_>>(), env);
        // The layer's diff id is its uncompressed tar's digest.
        let rootfs = dir.path().join("rootfs");
        std::fs::create_dir(&rootfs).unwrap();
        let layer_file =
            oci.join("blobs/sha256").join(layer["digest"].as_str().unwrap().strip_prefix("sha256:").unwrap());
        let unpacked = ran(
            "gzip",
            Command::new("sh").arg("-c").arg(format!("gzip -dc {} | sha256sum", layer_file.display())).output(),
        );
        assert_eq!(config["rootfs"]["diff_ids"][0], format!("sha256:{}", unpacked.split_whitespace().next().unwrap()));
        ran("tar", Command::new("tar").arg("-xzf").arg(&layer_file).arg("-C").arg(&rootfs).output());
        for file in
            ["usr/bin/outbox-relay", "etc/ssl/certs/ca-certificates.crt", "etc/outbox-relay/relay.toml", "etc/passwd"]
        {
            assert!(rootfs.join(file).exists(), "{file} in the image");
        }
        let certs = std::fs::read_to_string(rootfs.join("etc/ssl/certs/ca-certificates.crt")).unwrap();
        assert!(certs.matches("BEGIN CERTIFICATE").count() > 100, "Debian's trusted roots, bundled");

        if !is_root() {
            eprintln!("skipped: running the image's root filesystem needs root (chroot); it was built and checked");
            return;
        }
        // As installed, the config gives no destination: the default command refuses to start,
        // saying so, rather than send events anywhere.
        let chroot = ran("which", Command::new("which").arg("chroot").output()).trim().to_string();
        let entrypoint: Vec<&str> = run["Entrypoint"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let cmd: Vec<&str> = run["Cmd"].as_array().unwrap().iter().map(|v| v.as_str().unwrap()).collect();
        let image_env: Vec<(&str, &str)> = env.iter().filter_map(|e| e.split_once('=')).collect();
        let refused = Command::new(&chroot)
            .arg("--userspec=65532:65532")
            .arg(&rootfs)
            .args(&entrypoint)
            .args(&cmd)
            .env_clear()
            .envs(image_env.iter().copied())
            .env("DATABASE_URL", "postgres://nobody@127.0.0.1:1/none")
            .output()
            .unwrap();
        assert_eq!(refused.status.code(), Some(2), "{}", String::from_utf8_lossy(&refused.stderr));
        assert!(String::from_utf8_lossy(&refused.stderr).contains("no [[destination]]"));
        // Started as an engine starts it with the operator's command (`docker run IMAGE run
        // --sink stdout`): its entrypoint, as uid 65532, with nothing of the host's but the
        // network (the image's environment, and the database's URL).
        let db = TestDb::new().await;
        let mut relay = tokio::process::Command::new(&chroot);
        relay
            .arg("--userspec=65532:65532")
            .arg(&rootfs)
            .args(&entrypoint)
            .args(["run", "--sink", "stdout"])
            .env_clear()
            .envs(image_env.iter().copied())
            .env("DATABASE_URL", &db.url);
        let (relay, mut out) = started(relay);
        let ids = publish(&db.url, 3).await;
        delivered(&mut out, &ids).await;
        let output = terminate_with_output(relay).await;
        assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));

        match Command::new("docker").arg("info").output() {
            Ok(info) if info.status.success() => {
                ran("docker load", Command::new("docker").arg("load").arg("-i").arg(&archive).output());
                let version = ran(
                    "docker run",
                    Command::new("docker").args(["run", "--rm", "outbox-relay:test", "--version"]).output(),
                );
                assert!(version.starts_with("outbox-relay "), "{version}");
                let _ = Command::new("docker").args(["image", "rm", "outbox-relay:test"]).output();
            }
            Ok(info) => eprintln!(
                "skipped: no container engine runs here ({}); the image was built, checked and run from its root filesystem",
                String::from_utf8_lossy(&info.stderr).lines().last().unwrap_or("docker info failed")
            ),
            Err(e) => eprintln!(
                "skipped: no container engine here (docker: {e}); the image was built, checked and run from its root filesystem"
            ),
        }
    }

    /// The Debian package installs with dpkg (the binary, the unit, the config and environment
    /// readable by the service's user only, the manual pages, the completions), runs as its
    /// system user the way its unit starts it, reloads on SIGHUP, and purges without a trace
    /// but its system user (Debian's policy keeps those).
    ///
    /// It changes the machine (a package, a system user), so it runs only where
    /// `OUTBOX_RELAY_TEST_DPKG=1` says the machine is there for it (`.ci/run` does), and never
    /// over an installation it did not make.
    #[tokio::test]
    async fn the_debian_package_installs_runs_as_its_user_and_purges() {
        if std::env::var("OUTBOX_RELAY_TEST_DPKG").as_deref() != Ok("1") {
            eprintln!(
                "skipped: installing the Debian package changes this machine; OUTBOX_RELAY_TEST_DPKG=1 allows it"
            );
            return;
        }
        if !is_root() || Command::new("dpkg").arg("--version").output().is_err() {
            eprintln!("skipped: installing a Debian package needs root and dpkg");
            return;
        }
        let status = Command::new("dpkg-query").args(["-W", "-f=${Status}", "outbox-relay"]).output().unwrap();
        if String::from_utf8_lossy(&status.stdout).contains("installed") {
            eprintln!("skipped: an outbox-relay package is installed on this machine already; not touching it");
            return;
        }
        let dir = tempfile::tempdir().unwrap();
        let built = Command::new(root().join("packaging/deb/build"))
            .args(["--binary", BIN, "--out", dir.path().to_str().unwrap()])
            .output();
        let deb = ran("packaging/deb/build", built).trim().to_string();
        let installed = Installed::install(&deb);
        let user = ran("getent", Command::new("getent").args(["passwd", "outbox-relay"]).output());
        assert!(user.contains("/usr/sbin/nologin"), "{user}");
        for (file, mode) in [
            ("/etc/outbox-relay/relay.toml", "640 root outbox-relay"),
            ("/etc/default/outbox-relay", "640 root outbox-relay"),
        ] {
            let stat = ran("stat", Command::new("stat").args(["-c", "%a %U %G", file]).output());
            assert_eq!(stat.trim(), mode, "{file}");
        }
        for file in [
            "/usr/bin/outbox-relay",
            "/usr/share/man/man1/outbox-relay-run.1.gz",
            "/usr/share/bash-completion/completions/outbox-relay",
            "/usr/share/zsh/vendor-completions/_outbox-relay",
        ] {
            assert!(Path::new(file).exists(), "{file} installed");
        }
        let unit = std::fs::read_to_string("/lib/systemd/system/outbox-relay.service").unwrap();
        assert!(unit.contains("ExecReload=/bin/kill -HUP $MAINPID") && unit.contains("User=outbox-relay"), "{unit}");
        if Command::new("systemd-analyze").arg("--version").output().is_ok_and(|o| o.status.success()) {
            ran(
                "systemd-analyze verify",
                Command::new("systemd-analyze").args(["verify", "/lib/systemd/system/outbox-relay.service"]).output(),
            );
        }
        // Configured as the operator does (a destination in relay.toml, the database in the
        // environment file), then started as the unit starts it: its user (systemd's User= and
        // Group= are setpriv's switch, no PAM session), its environment file, its ExecStart.
        let db = TestDb::new().await;
        let config = "[[destination]]\nname = \"default\"\npattern = \"#\"\nsink = \"stdout\"\n";
        std::fs::write("/etc/outbox-relay/relay.toml", config).unwrap();
        let defaults = std::fs::read_to_string("/etc/default/outbox-relay").unwrap();
        let ours = format!("{defaults}DATABASE_URL={}\nOUTBOX_RELAY_ARGS=--workers 3\n", db.url);
        std::fs::write("/etc/default/outbox-relay", ours).unwrap();
        let environment: Vec<(String, String)> = std::fs::read_to_string("/etc/default/outbox-relay")
            .unwrap()
            .lines()
            .filter(|l| !l.trim_start().starts_with('#'))
            .filter_map(|l| {
                l.split_once('=').map(|(k, v)| (k.trim().to_string(), v.trim().trim_matches('"').to_string()))
            })
            .collect();
        let extra = environment.iter().find(|(k, _)| k == "OUTBOX_RELAY_ARGS").map(|(_, v)| v.clone());
        let exec = unit.lines().find_map(|l| l.strip_prefix("ExecStart=")).unwrap();
        let exec = exec.replace("$OUTBOX_RELAY_ARGS", &extra.unwrap_or_default());
        let mut relay = tokio::process::Command::new("setpriv");
        relay
            .args(["--reuid=outbox-relay", "--regid=outbox-relay", "--init-groups", "--"])
            .args(exec.split_whitespace())
            .env_clear()
            .env("PATH", "/usr/bin:/bin")
            .envs(environment);
        let (mut relay, mut out) = started(relay);
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let mut lines = tokio::io::BufReader::new(relay.stderr.take().unwrap()).lines();
        let kept = log.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                kept.lock().unwrap().push_str(&(line + "\n"));
            }
        });
        let ids = publish(&db.url, 3).await;
        delivered(&mut out, &ids).await;
        // ExecReload: SIGHUP reads the config again.
        let pid = relay.id().unwrap().to_string();
        ran("kill -HUP", Command::new("kill").args(["-HUP", &pid]).output());
        crate::relay_support::eventually("the config reloaded", || async {
            log.lock().unwrap().contains("--config reloaded")
        })
        .await;
        let ids = publish(&db.url, 2).await;
        delivered(&mut out, &ids).await;
        relay.stdout = None;
        crate::binary::send_sigterm(&relay);
        let status = tokio::time::timeout(crate::relay_support::PATIENCE, relay.wait()).await.unwrap().unwrap();
        assert_eq!(status.code(), Some(0), "{}", log.lock().unwrap());
        assert!(log.lock().unwrap().contains("workers=3"), "OUTBOX_RELAY_ARGS reached run: {}", log.lock().unwrap());
        drop(installed);
        for gone in [
            "/usr/bin/outbox-relay",
            "/etc/outbox-relay",
            "/etc/default/outbox-relay",
            "/lib/systemd/system/outbox-relay.service",
        ] {
            assert!(!Path::new(gone).exists(), "{gone} purged");
        }
    }

    /// The package installed for the test's length, purged at its end however it ends.
    struct Installed;

    impl Installed {
        fn install(deb: &str) -> Installed {
            ran("dpkg -i", Command::new("dpkg").args(["-i", deb]).output());
            Installed
        }
    }

    impl Drop for Installed {
        fn drop(&mut self) {
            let _ = Command::new("dpkg").args(["--purge", "outbox-relay"]).output();
        }
    }
}

/// docs/docker-compose.yml read with a YAML parser (python3's PyYAML).
mod needs_python {
    use super::*;
    use crate::harness::TestDb;
    use crate::relay_support::{count, eventually, free_port};

    /// docs/docker-compose.yml's receiver and relay, each run with the command, entrypoint and
    /// environment the file gives it (only the addresses changed for this machine's), and its
    /// event published as its header says: the receiver gets it. The images it names are the
    /// ones packaging/image/build makes.
    #[tokio::test]
    async fn the_compose_files_services_run_as_it_says() {
        let file = root().join("docs/docker-compose.yml");
        let json = ran(
            "python3 (PyYAML)",
            Command::new("python3")
                .args(["-c", "import json, sys, yaml; print(json.dumps(yaml.safe_load(open(sys.argv[1]))))"])
                .arg(&file)
                .output(),
        );
        let compose: Value = serde_json::from_str(&json).unwrap();
        let services = &compose["services"];
        let version = ran("outbox-relay --version", Command::new(BIN).arg("--version").output());
        let image = format!("outbox-relay:{}", version.split_whitespace().last().unwrap());
        assert_eq!(
            (&services["relay"]["image"], &services["receiver"]["image"]),
            (&image.clone().into(), &image.into())
        );
        let receiver_path = services["receiver"]["entrypoint"][0].as_str().unwrap();
        let script = std::fs::read_to_string(root().join("packaging/image/build")).unwrap();
        assert!(script.contains(receiver_path.trim_start_matches('/')), "the image script installs {receiver_path}");

        let db = TestDb::new().await;
        let (receiver_port, http_port) = (free_port(), free_port());
        let here = |text: &str| {
            text.replace("postgres://postgres:example@postgres:5432/shop", &db.url)
                .replace("0.0.0.0:9090", &format!("127.0.0.1:{receiver_port}"))
                .replace("receiver:9090", &format!("127.0.0.1:{receiver_port}"))
                .replace("0.0.0.0:9187", &format!("127.0.0.1:{http_port}"))
        };
        let start = |binary: &Path, service: &Value| {
            let args: Vec<String> =
                service["command"].as_array().unwrap().iter().map(|a| here(a.as_str().unwrap())).collect();
            let env = service["environment"].as_object().unwrap();
            tokio::process::Command::new(binary)
                .args(&args)
                .envs(env.iter().map(|(k, v)| (k.clone(), here(v.as_str().unwrap()))))
                .env_remove("RUST_LOG")
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::piped())
                .kill_on_drop(true)
                .spawn()
                .unwrap()
        };
        // target/<profile>/deps/it-<hash> -> target/<profile>/examples/webhook_receiver
        let test = std::env::current_exe().unwrap();
        let example = test.parent().and_then(|deps| deps.parent()).unwrap().join("examples/webhook_receiver");
        assert!(
            example.is_file(),
            "{} is built by `cargo test` (or cargo build --examples --all-features)",
            example.display()
        );
        let receiver = start(&example, &services["receiver"]);
        let relay = start(Path::new(BIN), &services["relay"]);
        let (client, connection) = tokio_postgres::connect(&db.url, tokio_postgres::NoTls).await.unwrap();
        tokio::spawn(connection);
        // The statement the file's header gives.
        let header = std::fs::read_to_string(&file).unwrap();
        let statement =
            header.lines().find_map(|l| l.split("-c \"").nth(1)).unwrap().trim_end_matches('"').replace("\\\"", "\"");
        eventually("the receiver serves", || async {
            std::net::TcpStream::connect(("127.0.0.1", receiver_port)).is_ok()
        })
        .await;
        client.batch_execute(&statement).await.unwrap();
        eventually("the receiver got the event", || async {
            count(&client, "select count(*) from received_events where topic = 'order.placed'").await == 1
        })
        .await;
        for child in [relay, receiver] {
            let output = crate::binary::terminate_with_output(child).await;
            assert_eq!(output.status.code(), Some(0), "{}", String::from_utf8_lossy(&output.stderr));
        }
    }
}

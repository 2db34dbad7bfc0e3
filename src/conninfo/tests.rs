use super::*;

fn parse(text: &str) -> ConnInfo {
    ConnInfo::parse(text).unwrap_or_else(|e| panic!("{text}: {e}"))
}

fn password(info: &ConnInfo) -> String {
    String::from_utf8(info.config.get_password().unwrap().to_vec()).unwrap()
}

#[test]
fn a_slash_in_a_url_password_is_parsed_and_never_shown() {
    let info = parse("postgres://u:right/pw+x@host/db");
    assert_eq!(password(&info), "right/pw+x");
    assert_eq!(info.config.get_dbname(), Some("db"));
    assert_eq!(info.redacted(), "postgres://u:***@host:5432/db");
}

#[test]
fn an_at_sign_in_a_url_password_is_refused_without_showing_it() {
    let err = ConnInfo::parse("postgres://u:s3c@ret@host/db").unwrap_err();
    let text = err.to_string();
    assert!(text.contains("%40"), "{text}");
    assert!(!text.contains("s3c") && !text.contains("ret"), "{text}");
    let info = parse("postgres://u:s3c%40ret@host/db");
    assert_eq!(password(&info), "s3c@ret");
}

#[test]
fn the_scheme_may_be_upper_case() {
    let info = parse("POSTGRES://u:s3cret@db:6543/x");
    assert_eq!(info.redacted(), "postgres://u:***@db:6543/x");
    assert_eq!(parse("PostgreSQL://u@db/x").redacted(), "postgres://u@db:5432/x");
}

#[test]
fn key_value_strings_follow_the_libpq_grammar() {
    let info = parse("host=db  password = s3cret user=app");
    assert_eq!(password(&info), "s3cret");
    assert_eq!(info.redacted(), "postgres://app:***@db:5432/");

    let info = parse("password='x y' sslmode=require dbname=t1 host=db");
    assert_eq!(password(&info), "x y");
    assert_eq!(info.config.get_ssl_mode(), SslMode::Require, "the settings after a quoted value are kept");
    assert_eq!(info.config.get_dbname(), Some("t1"));

    let info = parse(r"host=db password='it\'s \\ fine' dbname=d\ b");
    assert_eq!(password(&info), r"it's \ fine");
    assert_eq!(info.config.get_dbname(), Some("d b"));
}

#[test]
fn tls_options_are_taken_out_in_both_forms() {
    let info = parse("postgres://u@db/x?sslmode=verify-full&sslrootcert=/etc/ca.pem&connect_timeout=5");
    assert_eq!(info.verify, Verify::Full);
    assert_eq!(info.root_cert.as_deref(), Some(std::path::Path::new("/etc/ca.pem")));
    assert_eq!(info.config.get_ssl_mode(), SslMode::Require);
    assert_eq!(info.config.get_connect_timeout(), Some(&std::time::Duration::from_secs(5)));
    assert_eq!(info.redacted(), "postgres://u@db:5432/x?sslmode=verify-full");

    let info = parse("host=db sslmode=verify-ca user=u sslrootcert='/a b/ca.pem'");
    assert_eq!(info.verify, Verify::Chain);
    assert_eq!(info.root_cert.as_deref(), Some(std::path::Path::new("/a b/ca.pem")));
    assert_eq!(info.config.get_user(), Some("u"));

    let info = parse("postgres://u@db/x?application_name=a%20b&sslmode=disable");
    assert_eq!(info.config.get_application_name(), Some("a b"));
    assert_eq!(info.config.get_ssl_mode(), SslMode::Disable);
}

#[test]
fn errors_never_show_a_value() {
    let secret = "s3cr3t-value";
    for text in [
        format!("PASSWORD={secret} host=db"),
        format!("host=db {secret}"),
        format!("host=db password='{secret}"),
        format!("postgres://u:{secret}@db:notaport/x"),
        format!("postgres://u:{secret}@db/x?sslmode=always-{secret}"),
        format!("postgres://u:{secret}@db/x?{secret}"),
        format!("host=db password = {secret} port={secret}"),
        format!("postgres://u:{secret}@db/x?Password={secret}"),
    ] {
        let err = ConnInfo::parse(&text).expect_err(&text);
        assert!(!err.to_string().contains(secret), "{text}: {err}");
        assert!(!format!("{err:?}").contains(secret), "{text}: {err:?}");
    }
}

#[test]
fn unknown_options_are_named() {
    let err = ConnInfo::parse("host=db PASSWORD=x").unwrap_err().to_string();
    assert!(err.contains("unknown connection option \"PASSWORD\" (option names are lower case)"), "{err}");
    let err = ConnInfo::parse("postgres://db/x?sslmod=require").unwrap_err().to_string();
    assert!(err.contains("unknown connection option \"sslmod\""), "{err}");
}

#[test]
fn the_url_rebuilt_from_the_parsed_form_parses_to_the_same_settings() {
    for text in [
        "postgres://u:right/pw+x@host:6543/db",
        "host=db password='x y' user='a b' dbname='my db' sslmode=require",
        "postgres://app@%2Fvar%2Frun%2Fpostgresql:5433/shop",
        "postgres://app:s3c%40ret@h1:5432,h2:5433/shop?sslmode=verify-full&sslrootcert=/etc/ca.pem",
    ] {
        let info = parse(text);
        let again = parse(&info.to_url());
        assert_eq!(again.config.get_user(), info.config.get_user(), "{text}");
        assert_eq!(again.config.get_password(), info.config.get_password(), "{text}");
        assert_eq!(again.config.get_hosts(), info.config.get_hosts(), "{text}");
        let ports = |c: &Config| if c.get_ports().is_empty() { vec![5432] } else { c.get_ports().to_vec() };
        assert_eq!(ports(&again.config), ports(&info.config), "{text}");
        assert_eq!(again.config.get_dbname(), info.config.get_dbname(), "{text}");
        assert_eq!(again.config.get_ssl_mode(), info.config.get_ssl_mode(), "{text}");
        assert_eq!((again.verify, &again.root_cert), (info.verify, &info.root_cert), "{text}");
    }
}

#[test]
fn socket_directories_and_several_hosts_are_shown() {
    let info = parse("postgres://app@%2Fvar%2Frun%2Fpostgresql/shop");
    assert_eq!(info.redacted(), "postgres://app@/var/run/postgresql/.s.PGSQL.5432/shop");
    let info = parse("postgres://app:pw@h1:5432,h2:5433/shop");
    assert_eq!(info.redacted(), "postgres://app:***@h1:5432,h2:5433/shop");
}

#[test]
fn a_url_of_another_database_is_named_as_such() {
    for (text, scheme) in [("mysql://root@db:3306/shop", "mysql"), ("MongoDB+srv://u:pw@db/x", "MongoDB+srv")] {
        let err = ConnInfo::parse(text).unwrap_err().to_string();
        assert!(
            err.contains(&format!("{scheme}:// is not PostgreSQL's; only postgres:// and postgresql:// URLs")),
            "{err}"
        );
        assert!(!err.contains("pw"), "{err}");
    }
    // A key=value string whose value holds "://" is not a URL.
    let err = ConnInfo::parse("host=db sslrootcert=file://x bogus").unwrap_err().to_string();
    assert!(!err.contains("is not PostgreSQL's"), "{err}");
    assert!(ConnInfo::parse("POSTGRESQL://u@db/x").is_ok());
}

/// `parse_with_env` with these variables and no others.
fn with_env(text: &str, vars: &[(&str, &str)]) -> Result<ConnInfo> {
    let vars: std::collections::HashMap<String, String> =
        vars.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
    ConnInfo::parse_with_env(text, &|name| vars.get(name).cloned())
}

#[test]
fn libpqs_environment_fills_what_the_string_leaves_out() {
    let info = with_env(
        "postgres://pwuser@db.example/shop",
        &[
            ("PGPASSWORD", "from-env"),
            ("PGHOST", "other-host"),
            ("PGPORT", "6543"),
            ("PGUSER", "other-user"),
            ("PGDATABASE", "other-db"),
            ("PGAPPNAME", "billing"),
            ("PGCONNECT_TIMEOUT", "7"),
            ("PGSSLMODE", "verify-full"),
            ("PGSSLROOTCERT", "/etc/ssl/db-root.pem"),
            ("PGOPTIONS", "-c statement_timeout=5s"),
        ],
    )
    .unwrap();
    let c = &info.config;
    // The URL wins where it says something: host, user, database.
    assert_eq!(c.get_hosts(), &[Host::Tcp("db.example".into())]);
    assert_eq!(c.get_user(), Some("pwuser"));
    assert_eq!(c.get_dbname(), Some("shop"));
    // The environment gives the rest.
    assert_eq!(c.get_password(), Some(&b"from-env"[..]));
    assert_eq!(c.get_ports(), &[6543]);
    assert_eq!(c.get_application_name(), Some("billing"));
    assert_eq!(c.get_connect_timeout(), Some(&std::time::Duration::from_secs(7)));
    assert_eq!(info.verify, Verify::Full);
    assert_eq!(c.get_ssl_mode(), SslMode::Require);
    assert_eq!(info.root_cert.as_deref(), Some(std::path::Path::new("/etc/ssl/db-root.pem")));
    assert_eq!(c.get_options(), Some("-c statement_timeout=5s"));
    let own = with_env("postgres://u@h/d?options=-c%20search_path%3Dx", &[("PGOPTIONS", "-c jit=off")]).unwrap();
    assert_eq!(own.config.get_options(), Some("-c search_path=x"), "the string's options win");

    // An empty string takes everything from the environment; the string's own settings win.
    let info = with_env("", &[("PGHOST", "h1,h2"), ("PGUSER", "u"), ("PGDATABASE", "d")]).unwrap();
    assert_eq!(info.config.get_hosts(), &[Host::Tcp("h1".into()), Host::Tcp("h2".into())]);
    assert_eq!(info.config.get_user(), Some("u"));
    let info = with_env(
        "host=db password=in-string sslmode=disable connect_timeout=3",
        &[("PGPASSWORD", "from-env"), ("PGSSLMODE", "verify-full"), ("PGCONNECT_TIMEOUT", "9")],
    )
    .unwrap();
    assert_eq!(info.config.get_password(), Some(&b"in-string"[..]));
    assert_eq!(info.config.get_ssl_mode(), SslMode::Disable);
    assert_eq!(info.verify, Verify::None);
    assert_eq!(info.config.get_connect_timeout(), Some(&std::time::Duration::from_secs(3)));
    // PGPORT for the URL's hosts that give none, an IPv6 address's included.
    let info = with_env("postgres://u@a,b:6000,[::1]/db", &[("PGPORT", "7000")]).unwrap();
    assert_eq!(info.config.get_ports(), &[7000, 6000, 7000]);
    let info = with_env("host=a port=6000", &[("PGPORT", "7000")]).unwrap();
    assert_eq!(info.config.get_ports(), &[6000]);
    #[cfg(unix)]
    {
        let info = with_env("dbname=x", &[("PGHOST", "/var/run/postgresql")]).unwrap();
        assert!(matches!(info.config.get_hosts(), [Host::Unix(_)]));
    }
}

#[test]
fn bad_environment_values_name_the_variable_never_the_value() {
    for (name, value, says) in [
        ("PGPORT", "54x32", "PGPORT is not a port number"),
        ("PGCONNECT_TIMEOUT", "soon", "PGCONNECT_TIMEOUT is not a number of seconds"),
        ("PGSSLMODE", "always", "PGSSLMODE: expected disable"),
    ] {
        let err = with_env("host=db", &[(name, value)]).unwrap_err().to_string();
        assert!(err.contains(says), "{name}: {err}");
        assert!(!err.contains(value), "{name}: {err}");
    }
}

#[cfg(unix)]
#[test]
fn the_password_file_gives_the_password_of_the_first_matching_line() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("pgpass");
    std::fs::write(
        &file,
        "# comment\nother:5432:*:app:wrong\ndb.example:6543:shop:app:first\\:colon\\\\slash\n*:*:*:app:fallback\n",
    )
    .unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let passfile = file.to_str().unwrap();
    let info = with_env("postgres://app@db.example:6543/shop", &[("PGPASSFILE", passfile)]).unwrap();
    assert_eq!(info.config.get_password(), Some(&b"first:colon\\slash"[..]));
    let info = with_env("postgres://app@elsewhere/x", &[("PGPASSFILE", passfile)]).unwrap();
    assert_eq!(info.config.get_password(), Some(&b"fallback"[..]));
    // PGPASSWORD comes first; ~/.pgpass when PGPASSFILE is not set.
    let info = with_env("postgres://app@elsewhere/x", &[("PGPASSFILE", passfile), ("PGPASSWORD", "env")]).unwrap();
    assert_eq!(info.config.get_password(), Some(&b"env"[..]));
    std::fs::copy(&file, dir.path().join(".pgpass")).unwrap();
    std::fs::set_permissions(dir.path().join(".pgpass"), std::fs::Permissions::from_mode(0o600)).unwrap();
    let info = with_env("postgres://app@elsewhere/x", &[("HOME", dir.path().to_str().unwrap())]).unwrap();
    assert_eq!(info.config.get_password(), Some(&b"fallback"[..]));
    // A file others may read is not used.
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let info = with_env("postgres://app@elsewhere/x", &[("PGPASSFILE", passfile)]).unwrap();
    assert_eq!(info.config.get_password(), None);
}

#[test]
fn no_host_anywhere_is_the_servers_socket_or_localhost_as_in_libpq() {
    let info = with_env("dbname=shop user=app", &[]).unwrap();
    let socket = ["/var/run/postgresql", "/tmp"]
        .into_iter()
        .find(|dir| std::path::Path::new(dir).join(".s.PGSQL.5432").exists());
    let expected = match socket {
        Some(dir) => Host::Unix(dir.into()),
        None => Host::Tcp("localhost".into()),
    };
    assert_eq!(info.config.get_hosts(), &[expected]);
    // A host given anywhere is taken as given.
    let info = with_env("dbname=shop", &[("PGHOST", "db.internal")]).unwrap();
    assert_eq!(info.config.get_hosts(), &[Host::Tcp("db.internal".into())]);
    let info = with_env("postgres://u@db/x", &[]).unwrap();
    assert_eq!(info.config.get_hosts(), &[Host::Tcp("db".into())]);
}

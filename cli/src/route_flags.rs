//! `run`'s per-route flags: a sink flag (`--timeout`, `--signing-secret`, `--subject-prefix`, …)
//! or a route's limit (`--concurrency`, `--fixed-concurrency`, `--rate-limit`) that follows a
//! `--route` applies to that route alone; given before the first `--route` (or with `--sink`), it
//! applies to every destination, as before. So mixed routes need no file:
//!
//! ```text
//! outbox-relay run --timeout 5s \
//!     --route 'erp=order.#=https://erp.example/hook' --signing-secret whsec_... \
//!     --route 'mail.*=nats://127.0.0.1:4222' --subject-prefix shop
//! ```
//!
//! The arguments are split before clap parses them: the command line without the flags that
//! follow routes is parsed as usual, and each route's flags are parsed by the same definitions
//! (`run --sink stdout FLAGS…`), so that their values are checked the same way.

use std::ffi::OsString;

use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};

use crate::args::{Cli, Command, RouteFlags};

/// The ids (as clap names the fields) of the flags that apply to the `--route` they follow.
pub(crate) const PER_ROUTE: &[&str] = &[
    "timeout",
    "subject_prefix",
    "create_stream",
    "exchange",
    "signing_secrets",
    "format",
    "cloudevents_source",
    "headers",
    "kafka_topic",
    "kafka_tls",
    "kafka_ca_file",
    "kafka_username",
    "kafka_password",
    "kafka_sasl_mechanism",
    "kafka_properties",
    "concurrency",
    "fixed_concurrency",
    "rate_limit",
];

/// Parses the command line, per-route flags included.
pub(crate) fn parse(args: Vec<OsString>) -> Result<Cli, clap::Error> {
    let (main, groups) = split(args);
    let mut cli = Cli::try_parse_from(main)?;
    if let Command::Run(run) = &mut cli.command {
        for (route, flags) in groups {
            run.route_flags.push(parse_group(route, flags)?);
        }
    }
    Ok(cli)
}

/// The flags that follow the `--route` number `route`, parsed as `run`'s own.
fn parse_group(route: usize, flags: Vec<OsString>) -> Result<RouteFlags, clap::Error> {
    let mut argv: Vec<OsString> = ["outbox-relay", "run", "--sink", "stdout"].map(OsString::from).to_vec();
    argv.extend(flags);
    let matches = Cli::command().try_get_matches_from(argv)?;
    let (_, run) = matches.subcommand().expect("run was given");
    let given =
        PER_ROUTE.iter().filter(|id| run.value_source(id) == Some(ValueSource::CommandLine)).map(|id| id.to_string());
    let given = given.collect();
    let Command::Run(args) = Cli::from_arg_matches(&matches)?.command else { unreachable!("run was given") };
    Ok(RouteFlags { route, given, args })
}

/// Splits `run`'s arguments: the command line without the per-route flags that follow a
/// `--route`, and those flags (with their values) by route.
fn split(args: Vec<OsString>) -> (Vec<OsString>, Vec<(usize, Vec<OsString>)>) {
    let command = Cli::command();
    let run = command.find_subcommand("run").expect("run is a command");
    // Long name -> whether it takes a value, for the per-route flags.
    let per_route: Vec<(String, bool)> = run
        .get_arguments()
        .filter(|arg| PER_ROUTE.contains(&arg.get_id().as_str()))
        .filter_map(|arg| Some((arg.get_long()?.to_string(), arg.get_action().takes_values())))
        .collect();
    let mut main = Vec::with_capacity(args.len());
    let mut groups: Vec<(usize, Vec<OsString>)> = Vec::new();
    let mut args = args.into_iter();
    let mut in_run = false;
    let mut routes = 0;
    while let Some(arg) = args.next() {
        let Some(text) = arg.to_str().map(str::to_string) else {
            main.push(arg);
            continue;
        };
        if !in_run {
            in_run = text == "run";
            main.push(arg);
            continue;
        }
        if text == "--" {
            main.push(arg);
            main.extend(args.by_ref());
            break;
        }
        if text == "--route" || text.starts_with("--route=") {
            routes += 1;
            main.push(arg);
            if text == "--route" {
                main.extend(args.next());
            }
            continue;
        }
        let long = text.strip_prefix("--").map(|flag| flag.split_once('=').map_or(flag, |(name, _)| name));
        let flag = long.and_then(|long| per_route.iter().find(|(name, _)| name == long));
        match flag {
            Some((_, takes_value)) if routes > 0 => {
                let group = match groups.last_mut() {
                    Some((route, flags)) if *route == routes - 1 => flags,
                    _ => {
                        groups.push((routes - 1, Vec::new()));
                        &mut groups.last_mut().expect("just pushed").1
                    }
                };
                group.push(arg);
                if *takes_value && !text.contains('=') {
                    group.extend(args.next());
                }
            }
            _ => main.push(arg),
        }
    }
    (main, groups)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split_str(args: &[&str]) -> (Vec<String>, Vec<(usize, Vec<String>)>) {
        let (main, groups) = split(args.iter().map(OsString::from).collect());
        let text = |args: Vec<OsString>| args.into_iter().map(|a| a.into_string().unwrap()).collect::<Vec<_>>();
        (text(main), groups.into_iter().map(|(n, flags)| (n, text(flags))).collect())
    }

    #[test]
    fn flags_after_a_route_are_its_own_and_flags_before_are_everyones() {
        let (main, groups) = split_str(&[
            "outbox-relay",
            "run",
            "--timeout",
            "5s",
            "--route",
            "erp=order.#=https://erp/hook",
            "--signing-secret",
            "whsec_x",
            "--workers",
            "4",
            "--format=cloudevents",
            "--route=mail.*=nats://127.0.0.1:4222",
            "--subject-prefix",
            "shop",
            "--kafka-tls",
        ]);
        assert_eq!(
            main,
            [
                "outbox-relay",
                "run",
                "--timeout",
                "5s",
                "--route",
                "erp=order.#=https://erp/hook",
                "--workers",
                "4",
                "--route=mail.*=nats://127.0.0.1:4222"
            ]
        );
        assert_eq!(
            groups,
            [
                (0, vec!["--signing-secret".to_string(), "whsec_x".into(), "--format=cloudevents".into()]),
                (1, vec!["--subject-prefix".to_string(), "shop".into(), "--kafka-tls".into()]),
            ]
        );
    }

    #[test]
    fn without_routes_nothing_is_split() {
        let args = ["outbox-relay", "--database-url", "postgres://x", "run", "--sink", "stdout", "--timeout", "1s"];
        let (main, groups) = split_str(&args);
        assert_eq!(main, args);
        assert!(groups.is_empty());
    }

    #[test]
    fn a_route_flag_is_parsed_and_checked_as_the_command_line_would() {
        let cli =
            parse(["outbox-relay", "run", "--route", "a=#=stdout", "--timeout", "2s"].map(OsString::from).to_vec())
                .unwrap();
        let Command::Run(run) = cli.command else { panic!("run") };
        assert_eq!(run.route_flags.len(), 1);
        assert_eq!(run.route_flags[0].given, ["timeout"]);
        assert_eq!(run.route_flags[0].args.timeout, std::time::Duration::from_secs(2));
        let bad =
            parse(["outbox-relay", "run", "--route", "a=#=stdout", "--timeout", "soon"].map(OsString::from).to_vec());
        assert!(bad.unwrap_err().to_string().contains("--timeout"));
    }
}

//! The docs against the parser (issue 44, item 9): every `outbox-relay` command line in a shell
//! block of README.md and docs/ parses as it is written, every flag of every command is named in
//! docs/command.md, and the migrations the docs list are the ones there are. (What the commands
//! print is checked against the docs by the integration tests: `cli::the_docs_status_example_*`.)

#![cfg(test)]

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

/// README.md and every page of docs/, with their text.
fn pages() -> Vec<(String, String)> {
    let mut paths = vec![root().join("README.md")];
    let mut docs: Vec<PathBuf> = std::fs::read_dir(root().join("docs"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "md"))
        .collect();
    docs.sort();
    paths.extend(docs);
    paths
        .into_iter()
        .map(|p| (p.strip_prefix(root()).unwrap().display().to_string(), std::fs::read_to_string(&p).unwrap()))
        .collect()
}

/// The `outbox-relay` command lines of the pages' shell blocks (`$ ` prompts and `sudo -u USER`
/// taken off, continuation lines joined), with where each is.
fn command_lines() -> Vec<(String, String)> {
    let mut found = Vec::new();
    for block in fenced(&["sh", "bash", "shell"]) {
        let mut pending: Option<(String, String)> = None;
        for (i, line) in block.lines.iter().enumerate() {
            if let Some((at, mut joined)) = pending.take() {
                joined.push(' ');
                joined.push_str(line.trim().trim_end_matches('\\'));
                if line.trim_end().ends_with('\\') {
                    pending = Some((at, joined));
                } else {
                    found.push((at, joined));
                }
                continue;
            }
            let mut command = line.trim().strip_prefix("$ ").unwrap_or(line.trim());
            if let Some(rest) = command.strip_prefix("sudo -u ") {
                command = rest.split_once(' ').map_or("", |(_, c)| c);
            }
            if !command.starts_with("outbox-relay ") {
                continue;
            }
            let at = format!("{}:{}", block.page, block.first_line + i);
            if command.ends_with('\\') {
                pending = Some((at, command.trim_end_matches('\\').to_string()));
            } else {
                found.push((at, command.to_string()));
            }
        }
    }
    found
}

/// A command line as the shell splits it, up to a comment, a pipe, a redirection or `&&`;
/// `"$NAME"` stands for a value of that variable's kind.
fn words(line: &str) -> Vec<String> {
    let mut words = Vec::new();
    let mut word = String::new();
    let mut quote: Option<char> = None;
    let mut any = false;
    for c in line.chars() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some(_), c) => word.push(c),
            (None, '\'' | '"') => {
                quote = Some(c);
                any = true;
            }
            (None, ' ' | '\t') => {
                if any || !word.is_empty() {
                    words.push(std::mem::take(&mut word));
                }
                any = false;
            }
            (None, '#' | '|' | '>' | '&') if word.is_empty() && !any => break,
            (None, c) => word.push(c),
        }
    }
    if any || !word.is_empty() {
        words.push(word);
    }
    words
        .into_iter()
        .map(|w| match w.as_str() {
            "$WEBHOOK_SECRET" => "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw".to_string(),
            _ => w,
        })
        .collect()
}

/// A fenced block of a page: where its first line is, and its lines.
struct Block {
    page: String,
    first_line: usize,
    lines: Vec<String>,
}

/// The fenced blocks of the pages whose info string is one of `langs`.
fn fenced(langs: &[&str]) -> Vec<Block> {
    let mut found = Vec::new();
    for (page, text) in pages() {
        // (the block open now, and whether it is one of `langs`)
        let mut open: Option<(Block, bool)> = None;
        for (n, line) in text.lines().enumerate() {
            match (&mut open, line.strip_prefix("```")) {
                (None, Some(info)) => {
                    let block = Block { page: page.clone(), first_line: n + 2, lines: Vec::new() };
                    open = Some((block, langs.contains(&info.trim())));
                }
                (Some(_), Some(_)) => {
                    if let Some((block, true)) = open.take() {
                        found.push(block);
                    }
                }
                (Some((block, _)), None) => block.lines.push(line.to_string()),
                (None, None) => {}
            }
        }
    }
    found
}

/// The fenced blocks of the pages whose info string is `lang`, each with where it starts (the
/// fence's line) and its text.
fn blocks(lang: &str) -> Vec<(String, String)> {
    fenced(&[lang])
        .into_iter()
        .map(|b| (format!("{}:{}", b.page, b.first_line - 1), b.lines.iter().map(|l| format!("{l}\n")).collect()))
        .collect()
}

#[test]
fn every_json_example_is_json() {
    let found = blocks("json");
    assert!(found.len() >= 3, "{found:?}");
    for (at, body) in found {
        // one document, or one object per line (a log)
        let whole = serde_json::from_str::<serde_json::Value>(&body).is_ok();
        let lines = body.lines().all(|l| serde_json::from_str::<serde_json::Value>(l).is_ok());
        assert!(whole || lines, "{at}: not JSON:\n{body}");
    }
}

#[test]
fn every_config_file_example_is_read_as_run_reads_it() {
    let found: Vec<_> = blocks("toml").into_iter().filter(|(_, body)| body.contains("[[destination]]")).collect();
    assert!(found.len() >= 2, "{found:?}");
    let dir = std::env::temp_dir().join(format!("outbox-relay-docs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    for (n, (at, body)) in found.iter().enumerate() {
        let path = dir.join(format!("{n}.toml"));
        std::fs::write(&path, body).unwrap();
        // (as the page runs it: a Kafka password from OUTBOX_RELAY_KAFKA_PASSWORD)
        let mut defaults = crate::sinks::SinkOptions::default();
        defaults.kafka.password = Some(pg_outbox_relay::sink::Secret::new("from-the-environment"));
        let read = crate::routes::read_file(&path, &defaults);
        assert!(read.is_ok(), "{at}: {}", read.err().map(|e| e.to_string()).unwrap_or_default());
    }
    // The packages' config as installed gives no destination (the service refuses to start
    // until it has one), and its examples, uncommented, are read as they are.
    let shipped = root().join("packaging/relay.toml");
    let refused = crate::routes::read_file(&shipped, &Default::default()).expect_err("no destination as shipped");
    assert!(refused.to_string().contains("no [[destination]]"), "{refused}");
    let text = std::fs::read_to_string(&shipped).unwrap();
    let uncommented: String = text
        .lines()
        .map(|l| match l.strip_prefix('#') {
            Some(rest) if rest.starts_with(|c: char| c.is_ascii_alphabetic() || c == '[') => rest,
            _ => l,
        })
        .map(|l| format!("{l}\n"))
        .collect();
    let path = dir.join("shipped.toml");
    std::fs::write(&path, uncommented).unwrap();
    let examples = crate::routes::read_file(&path, &Default::default());
    assert_eq!(examples.map(|d| d.len()).map_err(|e| e.to_string()), Ok(2), "packaging/relay.toml's examples");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn every_command_line_in_the_docs_parses() {
    let lines = command_lines();
    assert!(lines.len() > 40, "the docs' command lines were found: {}", lines.len());
    let mut refused = Vec::new();
    for (at, line) in &lines {
        let argv: Vec<std::ffi::OsString> = words(line).into_iter().map(Into::into).collect();
        if let Err(e) = crate::route_flags::parse(argv) {
            refused.push(format!("{at}: {line}\n    {}", e.to_string().lines().next().unwrap_or_default()));
        }
    }
    assert!(refused.is_empty(), "command lines in the docs that the parser refuses:\n{}", refused.join("\n"));
}

#[test]
fn every_flag_of_every_command_is_in_command_md() {
    let text = std::fs::read_to_string(root().join("docs/command.md")).unwrap();
    let mut missing = Vec::new();
    fn walk(command: &clap::Command, path: &str, text: &str, missing: &mut Vec<String>) {
        for arg in command.get_arguments().filter(|a| !a.is_hide_set()) {
            let Some(long) = arg.get_long() else { continue };
            if ["help", "version"].contains(&long) {
                continue;
            }
            let named = format!("--{long}");
            let mentioned = text
                .match_indices(&named)
                .any(|(i, _)| !text[i + named.len()..].starts_with(|c: char| c.is_ascii_alphanumeric() || c == '-'));
            if !mentioned {
                missing.push(format!("{path} {named}"));
            }
        }
        for sub in command.get_subcommands() {
            // (its whole command line, `outbox-relay dead-letters list`, or its own heading)
            let full = format!("{path} {}", sub.get_name());
            if !text.contains(&full) && !text.contains(&format!("## `{}`", sub.get_name())) {
                missing.push(format!("{path} {} (the command)", sub.get_name()));
            }
            walk(sub, &format!("{path} {}", sub.get_name()), text, missing);
        }
    }
    walk(&<crate::args::Cli as clap::CommandFactory>::command(), "outbox-relay", &text, &mut missing);
    assert!(missing.is_empty(), "flags and commands docs/command.md does not name:\n{}", missing.join("\n"));
}

#[test]
fn the_migrations_the_docs_list_are_the_ones_there_are() {
    let mut migrations: Vec<String> = std::fs::read_dir(root().join("migrations"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".sql") && n.as_bytes()[0].is_ascii_digit())
        .map(|n| n.trim_end_matches(".sql").to_string())
        .collect();
    migrations.sort();
    let text = std::fs::read_to_string(root().join("docs/command.md")).unwrap();
    let last = migrations.last().unwrap();
    assert!(text.contains(&format!("applied {last}\n")), "docs/command.md's migrate shows {last} last");
    let n = migrations.len();
    assert!(text.contains(&format!("{n} applied, 0 already in place")), "docs/command.md: {n} applied");
    assert!(text.contains(&format!("nothing to apply: {n} migrations")), "docs/command.md: {n} migrations");
}

#[test]
fn the_sql_doors_python_in_write_path_md_is_the_example_a_test_runs() {
    // examples/sql_door/place_order.py is run by tests/it/sql_door_examples.rs: the page shows it.
    let shown = blocks("python").into_iter().find(|(at, _)| at.starts_with("docs/write-path.md")).expect("a block");
    let example = std::fs::read_to_string(root().join("examples/sql_door/place_order.py")).unwrap();
    assert!(example.contains(shown.1.trim_end()), "{}: not the text of examples/sql_door/place_order.py", shown.0);
}

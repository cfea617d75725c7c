//! Secret environment values: what a sandbox's environment keeps out of every record.
//!
//! Agents pass credentials as environment variables (`OPENAI_API_KEY=…`). A value is secret
//! when the create request names it in `secret_env`, or when its name looks like a
//! credential ([`looks_secret`]: `*_KEY`, `*_TOKEN`, `*_SECRET`, `*PASSWORD*`, `*PASSWD*`).
//! A secret value lives only in the server's memory, for the sandbox that runs with it, and
//! in the guest (its processes' environments, hence in its snapshots' memory files, which are
//! readable by the server alone). It is never written to the database, a snapshot's metadata,
//! a moved sandbox's record, the audit log, a log line or an API answer:
//! - at rest ([`at_rest`]) the value is replaced by [`AT_REST`], a marker no real value can
//!   equal (environment values cannot hold NUL); read back ([`restore`]) the entry is dropped
//!   and its name kept in the secret set — so a server that restarts no longer has the value
//!   and stops passing it to new programs (the guest's running processes keep theirs);
//! - in answers ([`shown`]) the value reads [`REDACTED`].

use std::collections::{BTreeMap, BTreeSet};

/// What an answer shows instead of a secret value.
pub const REDACTED: &str = "[redacted]";

/// What a record at rest holds instead of a secret value (NUL cannot be in a real value).
pub const AT_REST: &str = "\0secret";

/// Whether `name` looks like it holds a credential.
pub fn looks_secret(name: &str) -> bool {
    let n = name.to_ascii_uppercase();
    ["_KEY", "_TOKEN", "_SECRET"].iter().any(|s| n.ends_with(s))
        || ["PASSWORD", "PASSWD", "SECRET_"]
            .iter()
            .any(|s| n.contains(s))
        || matches!(n.as_str(), "TOKEN" | "SECRET" | "API_KEY" | "KEY")
}

/// The secret names of `env`: those `marked` by the caller plus those that look secret.
/// Marked names that are not in `env` are ignored.
pub fn secret_names(env: &BTreeMap<String, String>, marked: &BTreeSet<String>) -> BTreeSet<String> {
    env.keys()
        .filter(|k| marked.contains(*k) || looks_secret(k))
        .cloned()
        .collect()
}

/// `env` as it may be written anywhere: secret values replaced by [`AT_REST`].
pub fn at_rest(
    env: &BTreeMap<String, String>,
    secret: &BTreeSet<String>,
) -> BTreeMap<String, String> {
    replaced(env, secret, AT_REST)
}

/// `env` as an answer shows it: secret values replaced by [`REDACTED`].
pub fn shown(
    env: &BTreeMap<String, String>,
    secret: &BTreeSet<String>,
) -> BTreeMap<String, String> {
    replaced(env, secret, REDACTED)
}

fn replaced(
    env: &BTreeMap<String, String>,
    secret: &BTreeSet<String>,
    with: &str,
) -> BTreeMap<String, String> {
    env.iter()
        .map(|(k, v)| {
            let v = if secret.contains(k) { with } else { v.as_str() };
            (k.clone(), v.to_string())
        })
        .collect()
}

/// Reads back what [`at_rest`] wrote: the entries whose value was withheld are dropped from
/// `env`, and their names added to `secret`.
pub fn restore(env: &mut BTreeMap<String, String>, secret: &mut BTreeSet<String>) {
    env.retain(|k, v| {
        if v == AT_REST {
            secret.insert(k.clone());
            false
        } else {
            true
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn credential_names_are_recognised() {
        for n in [
            "OPENAI_API_KEY",
            "aws_secret_access_key",
            "GITHUB_TOKEN",
            "DB_PASSWORD",
            "PGPASSWD",
            "CLIENT_SECRET",
            "SECRET_THING",
            "TOKEN",
        ] {
            assert!(looks_secret(n), "{n}");
        }
        for n in [
            "PATH",
            "HOME",
            "KEYBOARD",
            "TOKENIZER_DIR",
            "LANG",
            "MONKEY_COUNT",
        ] {
            assert!(!looks_secret(n), "{n}");
        }
    }

    #[test]
    fn values_are_withheld_at_rest_and_redacted_in_answers() {
        let e = env(&[
            ("A", "1"),
            ("OPENAI_API_KEY", "sk-x"),
            ("DSN", "pg://u:p@h"),
        ]);
        let marked = ["DSN".to_string(), "ABSENT".to_string()].into();
        let s = secret_names(&e, &marked);
        assert_eq!(s, ["DSN".to_string(), "OPENAI_API_KEY".to_string()].into());
        let stored = at_rest(&e, &s);
        assert_eq!(stored["A"], "1");
        assert_eq!(stored["DSN"], AT_REST);
        assert!(!serde_json::to_string(&stored).unwrap().contains("sk-x"));
        assert_eq!(shown(&e, &s)["OPENAI_API_KEY"], REDACTED);
        let (mut back, mut names) = (stored, BTreeSet::new());
        restore(&mut back, &mut names);
        assert_eq!(back, env(&[("A", "1")]));
        assert_eq!(names, s);
    }

    #[test]
    fn a_value_equal_to_the_shown_marker_is_kept() {
        // Only the NUL marker means "withheld"; a user value "[redacted]" is a value.
        let mut e = env(&[("X", REDACTED)]);
        let mut s = BTreeSet::new();
        restore(&mut e, &mut s);
        assert_eq!(e["X"], REDACTED);
        assert!(s.is_empty());
    }
}

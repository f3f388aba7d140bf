//! What a command found: checks grouped in sections, each OK, WARN or FAIL with its detail
//! and, when something is wrong, what to do. Printed as text that fits a terminal, or as JSON.

use std::fmt::Write as _;

use serde::Serialize;

/// How a check came out.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Level {
    /// As it should be.
    Ok,
    /// Worth a look; not a failure (e.g. objects the agents reject).
    Warn,
    /// Wrong: the command exits 1.
    Fail,
}

impl Level {
    fn word(self) -> &'static str {
        match self {
            Level::Ok => "OK",
            Level::Warn => "WARN",
            Level::Fail => "FAIL",
        }
    }
}

/// One check.
#[derive(Debug, Serialize)]
pub struct Check {
    /// The outcome.
    pub level: Level,
    /// What was checked (a short name).
    pub what: String,
    /// What was found.
    pub detail: String,
    /// What to do about it, in words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub fix: Option<String>,
}

/// Checks about one thing (a member cluster, a node).
#[derive(Debug, Serialize)]
pub struct Section {
    /// e.g. `cluster c1 (context c1)`.
    pub title: String,
    /// In the order they were made.
    pub checks: Vec<Check>,
}

impl Section {
    /// An empty section.
    pub fn new(title: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            checks: Vec::new(),
        }
    }

    /// Adds a check.
    pub fn push(&mut self, level: Level, what: impl Into<String>, detail: impl Into<String>) {
        self.checks.push(Check {
            level,
            what: what.into(),
            detail: detail.into(),
            fix: None,
        });
    }

    /// Adds a check with what to do.
    pub fn push_fix(
        &mut self,
        level: Level,
        what: impl Into<String>,
        detail: impl Into<String>,
        fix: impl Into<String>,
    ) {
        self.checks.push(Check {
            level,
            what: what.into(),
            detail: detail.into(),
            fix: Some(fix.into()),
        });
    }

    /// The value of a read, or (a FAIL line `doing: error` added) none.
    pub fn read<T>(&mut self, r: Result<T, String>, what: &str, doing: &str) -> Option<T> {
        match r {
            Ok(v) => Some(v),
            Err(e) => {
                self.push(Level::Fail, what, format!("{doing}: {e}"));
                None
            }
        }
    }

    /// OK when `ok`, else `bad` with the fix.
    pub fn verdict(
        &mut self,
        ok: bool,
        bad: Level,
        what: &str,
        detail: impl Into<String>,
        fix: &str,
    ) {
        if ok {
            self.push(Level::Ok, what, detail);
        } else {
            self.push_fix(bad, what, detail, fix);
        }
    }
}

/// A command's whole answer.
#[derive(Debug, Serialize)]
pub struct Report {
    /// `status` or `explain NS/NAME`.
    pub command: String,
    /// The worst level found.
    pub level: Level,
    /// Every section.
    pub sections: Vec<Section>,
    /// The raw material (e.g. each agent's `/status`), for scripts.
    #[serde(skip_serializing_if = "serde_json::Value::is_null")]
    pub data: serde_json::Value,
}

impl Report {
    /// A report of `sections`; its level is the worst check's.
    pub fn new(command: String, sections: Vec<Section>, data: serde_json::Value) -> Self {
        let level = sections
            .iter()
            .flat_map(|s| s.checks.iter().map(|c| c.level))
            .max()
            .unwrap_or(Level::Ok);
        Self {
            command,
            level,
            sections,
            data,
        }
    }

    /// The text form: a block per section, a line per check, its fix below it. Every text
    /// that may come from an object, an agent or an API server (names, conditions, Lease
    /// holders, errors) has its control characters written as escapes, so none can erase or
    /// forge a line or drive the terminal.
    pub fn text(&self) -> String {
        use mcs_model::input::escaped;
        let width = self
            .sections
            .iter()
            .flat_map(|s| s.checks.iter().map(|c| c.what.chars().count()))
            .max()
            .unwrap_or(0)
            .min(28);
        let mut out = String::new();
        for s in &self.sections {
            let _ = writeln!(out, "{}", escaped(&s.title));
            for c in &s.checks {
                let _ = writeln!(
                    out,
                    "  {:<4}  {:<width$}  {}",
                    c.level.word(),
                    escaped(&c.what),
                    escaped(&c.detail)
                );
                if let Some(fix) = &c.fix {
                    let _ = writeln!(out, "        {:<width$}  fix: {}", "", escaped(fix));
                }
            }
            out.push('\n');
        }
        let (fails, warns) =
            self.sections
                .iter()
                .flat_map(|s| &s.checks)
                .fold((0, 0), |(f, w), c| match c.level {
                    Level::Fail => (f + 1, w),
                    Level::Warn => (f, w + 1),
                    Level::Ok => (f, w),
                });
        let _ = writeln!(
            out,
            "{}: {}",
            self.command,
            match (fails, warns) {
                (0, 0) => "everything OK".to_string(),
                (0, w) => format!("OK, {w} warning(s)"),
                (f, w) => format!("{f} failure(s), {w} warning(s)"),
            }
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_worst_check_decides_and_fixes_are_printed_under_their_line() {
        let mut a = Section::new("cluster c1");
        a.push(Level::Ok, "reachable", "v1.36.0");
        let mut b = Section::new("cluster c2");
        b.push_fix(
            Level::Fail,
            "reachable",
            "connection refused",
            "start c2's API server",
        );
        b.push(Level::Warn, "rejected", "1 object");
        let r = Report::new("status".into(), vec![a, b], serde_json::Value::Null);
        assert_eq!(r.level, Level::Fail);
        let t = r.text();
        assert!(t.contains("  OK    reachable  v1.36.0\n"), "{t}");
        assert!(
            t.contains("  FAIL  reachable  connection refused\n                   fix: start c2's API server\n"),
            "{t}"
        );
        assert!(t.ends_with("status: 1 failure(s), 1 warning(s)\n"), "{t}");
        let j = serde_json::to_value(&r).unwrap();
        assert_eq!(j["level"], "fail");
        assert_eq!(
            j["sections"][1]["checks"][0]["fix"],
            "start c2's API server"
        );
        assert!(j.get("data").is_none());
    }

    /// Issue 52: a condition message, an agent's answer or a Lease holder with an ESC (or a
    /// newline) is printed escaped: it can neither erase a FAIL line nor forge one.
    #[test]
    fn control_characters_from_objects_are_printed_escaped() {
        let mut s = Section::new("cluster c1\u{1b}[2J");
        s.push_fix(
            Level::Fail,
            "export Valid",
            "False: \u{1b}[1A\u{1b}[2K  OK    everything fine\nstatus: everything OK",
            "look at \u{7}it",
        );
        let t = Report::new("status".into(), vec![s], serde_json::Value::Null).text();
        assert!(!t.contains('\u{1b}') && !t.contains('\u{7}'), "{t:?}");
        assert!(
            t.contains("False: \\u{1b}[1A\\u{1b}[2K  OK    everything fine\\nstatus"),
            "{t}"
        );
        assert!(t.starts_with("cluster c1\\u{1b}[2J\n"), "{t}");
        assert!(t.ends_with("status: 1 failure(s), 0 warning(s)\n"), "{t}");
    }
}

//! The agent's allocator: mimalloc, told to give freed memory back to the system at once,
//! and the process kept off transparent huge pages.
//!
//! Why not glibc's malloc: with the runtime's threads it keeps an arena per thread, and the
//! agent held ~130 MiB more at 1M endpoints (556 vs 427 MiB, docs/performance.md). Why the two
//! purge options: a full sync allocates and frees the list responses it reads (tens of MB); with
//! mimalloc's defaults that memory stayed resident for a second or more, and arenas were
//! committed ahead of use. At 10k imports the agent's RSS went from ~95 to ~63 MiB, with the
//! sync no slower.
//!
//! Why no transparent huge pages: mimalloc asks for them (`madvise(MADV_HUGEPAGE)` on its
//! arenas), so on a node whose THP setting is `madvise` (or `always`) the kernel's khugepaged
//! collapses the arena's sparsely used 2 MiB ranges into huge pages whenever its scan reaches
//! the process: in a 25-minute soak every agent's RSS stepped once by ~8 MiB (four huge pages)
//! at a random time, with the same work before and after. A node agent's heap is small and
//! its hot path is the kernel's: the TLB gains nothing worth memory that depends on when a
//! kernel thread passes. So mimalloc is built without that `madvise` (feature `no_thp`: it
//! would otherwise already have advised the arena that serves the allocations made before
//! `main`, and their first fault takes a huge page), its `allow_thp` is cleared, and the
//! process sets `PR_SET_THP_DISABLE`, which also covers a node whose setting is `always`.
//! `MIMALLOC_ALLOW_THP` in the environment (any value) leaves the last two as they are.
//!
//! `unsafe`: the options are set by calling mimalloc's C functions, before any other thread
//! exists; `/status` reads its process counters (`mi_process_info`) the same way. The
//! option numbers are mimalloc v3's (`mi_option_e` in its `mimalloc.h`): the Rust
//! binding names neither. An option is changed only while it holds v3's documented default,
//! so a library with other numbers (or an option the operator set with `MIMALLOC_*`) is left
//! alone and said so.
#![allow(unsafe_code)]

use libmimalloc_sys::{mi_option_get, mi_option_set, mi_option_t, mi_process_info};
use mcs_model::status::HeapInfo;

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_arena_eager_commit`: commit arenas when reserved (2: on overcommit systems).
const ARENA_EAGER_COMMIT: mi_option_t = 4;
/// `mi_option_purge_delay`: milliseconds before freed memory is given back.
const PURGE_DELAY: mi_option_t = 15;
/// `mi_option_allow_thp`: 1 (default) advises transparent huge pages on what it maps.
const ALLOW_THP: mi_option_t = 43;

/// What [`tune`] did, for the log (the logger does not exist yet when it runs).
pub struct Note {
    /// It did not do what it meant to (a warning; else a debug line).
    pub failed: bool,
    pub text: String,
}

impl Note {
    fn done(text: String) -> Self {
        Self {
            failed: false,
            text,
        }
    }
}

/// Sets the options and the process's THP flag; returns what it did.
pub fn tune() -> Vec<Note> {
    let thp_asked = std::env::var_os("MIMALLOC_ALLOW_THP").is_some();
    let mut options = vec![
        ("purge_delay", PURGE_DELAY, 1000, 0),
        ("arena_eager_commit", ARENA_EAGER_COMMIT, 2, 0),
    ];
    if !thp_asked {
        options.push(("allow_thp", ALLOW_THP, 1, 0));
    }
    let mut notes: Vec<Note> = options
        .into_iter()
        .map(|(name, option, default, value)| {
            // SAFETY: reading and writing an option of the global allocator, by its number,
            // from the only thread (called first thing in `main`).
            let now = unsafe { mi_option_get(option) };
            Note::done(if now == default {
                unsafe { mi_option_set(option, value) };
                format!("mimalloc {name} {now} -> {value}")
            } else {
                format!("mimalloc {name} is {now}, not the default {default}: left as it is")
            })
        })
        .collect();
    notes.push(if thp_asked {
        Note::done(
            "MIMALLOC_ALLOW_THP is set: transparent huge pages left as the node has them".into(),
        )
    } else {
        match nix::sys::prctl::set_thp_disable(true) {
            Ok(()) => Note::done(
                "transparent huge pages off for this process (PR_SET_THP_DISABLE)".into(),
            ),
            Err(e) => Note {
                failed: true,
                text: format!(
                    "could not turn transparent huge pages off (PR_SET_THP_DISABLE): {e}"
                ),
            },
        }
    });
    notes
}

/// The allocator's view now: what it has committed and what it sees of the process, and the
/// kernel's side of the heap (huge pages).
pub fn heap_info() -> HeapInfo {
    let (mut rss, mut commit, mut peak_commit) = (0usize, 0usize, 0usize);
    // SAFETY: every out-parameter is a valid pointer to a usize or null (optional, per
    // mimalloc's documentation); the call only reads process counters.
    unsafe {
        mi_process_info(
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            &mut rss,
            std::ptr::null_mut(),
            &mut commit,
            &mut peak_commit,
            std::ptr::null_mut(),
        );
    }
    HeapInfo {
        committed_bytes: commit,
        peak_committed_bytes: peak_commit,
        rss_bytes: rss,
        thp_disabled: nix::sys::prctl::get_thp_disable().unwrap_or(false),
        anon_huge_pages_bytes: std::fs::read_to_string("/proc/self/smaps_rollup")
            .ok()
            .and_then(|rollup| kib_field(&rollup, "AnonHugePages:"))
            .map(|kib| kib * 1024),
    }
}

/// The value of a `Name:   123 kB` line of a `/proc` file, in KiB.
fn kib_field(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

#[cfg(test)]
mod tests {
    #[test]
    fn reads_a_kib_field_of_smaps_rollup() {
        let rollup = "Rss:               47104 kB\nAnonymous:         19200 kB\nAnonHugePages:      8192 kB\n";
        assert_eq!(super::kib_field(rollup, "AnonHugePages:"), Some(8192));
        assert_eq!(super::kib_field(rollup, "Rss:"), Some(47104));
        assert_eq!(super::kib_field(rollup, "ShmemHugePages:"), None);
    }
}

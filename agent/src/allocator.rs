//! The agent's allocator: mimalloc, told to give freed memory back to the system at once.
//!
//! Why not glibc's malloc: with the runtime's threads it keeps an arena per thread, and the
//! agent held ~130 MiB more at 1M endpoints (556 vs 427 MiB, docs/performance.md). Why the two
//! options: a full sync allocates and frees the list responses it reads (tens of MB); with
//! mimalloc's defaults that memory stayed resident for a second or more, and arenas were
//! committed ahead of use. At 10k imports the agent's RSS went from ~95 to ~63 MiB, with the
//! sync no slower.
//!
//! `unsafe`: the options are set by calling mimalloc's C functions, before any other thread
//! exists; `/status` reads its process counters (`mi_process_info`) the same way. The
//! option numbers are mimalloc v3's (`mi_option_e` in its `mimalloc.h`): the Rust
//! binding names neither. An option is changed only while it holds v3's documented default,
//! so a library with other numbers (or an option the operator set with `MIMALLOC_*`) is left
//! alone and said so.
#![allow(unsafe_code)]

use libmimalloc_sys::{mi_option_get, mi_option_set, mi_option_t, mi_process_info};

#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `mi_option_arena_eager_commit`: commit arenas when reserved (2: on overcommit systems).
const ARENA_EAGER_COMMIT: mi_option_t = 4;
/// `mi_option_purge_delay`: milliseconds before freed memory is given back.
const PURGE_DELAY: mi_option_t = 15;

/// Sets the options; returns what it did, for the log (the logger does not exist yet).
pub fn tune() -> Vec<String> {
    [
        ("purge_delay", PURGE_DELAY, 1000, 0),
        ("arena_eager_commit", ARENA_EAGER_COMMIT, 2, 0),
    ]
    .into_iter()
    .map(|(name, option, default, value)| {
        // SAFETY: reading and writing an option of the global allocator, by its number, from
        // the only thread (called first thing in `main`).
        let now = unsafe { mi_option_get(option) };
        if now == default {
            unsafe { mi_option_set(option, value) };
            format!("mimalloc {name} {now} -> {value}")
        } else {
            format!("mimalloc {name} is {now}, not the default {default}: left as it is")
        }
    })
    .collect()
}

/// What the allocator says of the process, for `/status`: bytes it has committed now and at
/// most (mimalloc estimates both on Linux from what it reserved read/write), and the RSS it
/// sees. Beside the kernel's RSS, this tells memory the heap holds from code and stacks.
#[derive(Debug, serde::Serialize)]
pub struct HeapInfo {
    /// Committed by the allocator now.
    pub committed_bytes: usize,
    /// The most it ever had committed.
    pub peak_committed_bytes: usize,
    /// The process's resident set as the allocator reads it.
    pub rss_bytes: usize,
}

/// The allocator's view now.
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
    }
}

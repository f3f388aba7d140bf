//! Maglev consistent hashing (Eisenbud et al., NSDI 2016): a lookup table of prime size `M`
//! in which every backend owns about `M / n` entries, filled from per-backend permutations,
//! so that removing one backend moves only the flows it had (plus a small fraction).

/// Default (and largest) table size: a prime.
pub const DEFAULT_TABLE_SIZE: usize = 16_381;

/// Primes the table size is chosen from.
const PRIMES: [usize; 9] = [251, 509, 1_021, 2_039, 4_093, 8_191, 16_381, 32_749, 65_521];

/// The table size for `backends`: the smallest listed prime ≥ 100 × backends (≤ 1% load
/// imbalance), at most `cap` (if `cap` is smaller than that, the largest prime ≤ cap, and
/// always more than `backends`). Small services get small tables: 10k frontends of 10 backends
/// take 1021 × 4 B each, not 16381 × 4 B.
pub fn table_size_for(backends: usize, cap: usize) -> usize {
    let want = backends.saturating_mul(100).max(1);
    let fit = PRIMES
        .iter()
        .copied()
        .find(|&p| p >= want)
        .unwrap_or(PRIMES[PRIMES.len() - 1]);
    let capped = PRIMES
        .iter()
        .copied()
        .rfind(|&p| p <= cap.max(PRIMES[0]))
        .unwrap_or(PRIMES[0]);
    let size = fit.min(capped);
    if size > backends {
        size
    } else {
        PRIMES
            .iter()
            .copied()
            .find(|&p| p > backends)
            .unwrap_or(PRIMES[PRIMES.len() - 1])
    }
}

fn is_prime(n: usize) -> bool {
    n >= 2
        && (2..)
            .take_while(|d| d * d <= n)
            .all(|d| !n.is_multiple_of(d))
}

/// A Maglev lookup table: entry → backend index. Indices are `u16`: a table has at most
/// 65,521 entries and fewer backends than entries, so two bytes an entry hold every index
/// (a 10-backend table is 2 KB, not 4).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Maglev {
    table: Box<[u16]>,
}

/// Marks an entry not yet filled (above every index).
const EMPTY: u16 = u16::MAX;

fn hash(data: &[u8], seed: u64) -> u64 {
    // FNV-1a with a seed folded in, then a 64-bit finalizer (splitmix64) to spread bits.
    let mut h = 0xcbf2_9ce4_8422_2325u64 ^ seed.wrapping_mul(0x9e37_79b9_7f4a_7c15);
    for &b in data {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    mix(h)
}

/// splitmix64 finalizer.
pub fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

impl Maglev {
    /// Builds the table for backends named by `keys` (stable names, e.g. `addr:port`), with a
    /// prime `size` larger than the number of backends. Empty `keys` give an empty table.
    pub fn new<K: AsRef<[u8]>>(keys: &[K], size: usize) -> Self {
        let n = keys.len();
        if n == 0 {
            return Self {
                table: Box::new([]),
            };
        }
        // The size must be a prime above n (else the fill does not end): a caller's smaller
        // size is raised to one, never a panic.
        let largest = PRIMES[PRIMES.len() - 1];
        let size = if size > n && size <= largest && is_prime(size) {
            size
        } else {
            table_size_for(n, usize::MAX)
        };
        // More backends than the largest table has entries: the first ones only.
        let n = n.min(size - 1);
        let keys = &keys[..n];
        let m = size as u64;
        let (offset, skip): (Vec<u64>, Vec<u64>) = keys
            .iter()
            .map(|k| (hash(k.as_ref(), 0) % m, hash(k.as_ref(), 1) % (m - 1) + 1))
            .unzip();
        let mut next = vec![0u64; n];
        let mut table = vec![EMPTY; size];
        let mut filled = 0;
        'outer: loop {
            for i in 0..n {
                let mut c = (offset[i] + next[i] * skip[i]) % m;
                while table[c as usize] != EMPTY {
                    next[i] += 1;
                    c = (offset[i] + next[i] * skip[i]) % m;
                }
                // i < n < size <= 65,521: fits.
                table[c as usize] = i as u16;
                next[i] += 1;
                filled += 1;
                if filled == size {
                    break 'outer;
                }
            }
        }
        Self {
            table: table.into_boxed_slice(),
        }
    }

    /// The backend index for a flow hash; `None` when there are no backends.
    #[inline]
    pub fn pick(&self, flow_hash: u64) -> Option<usize> {
        if self.table.is_empty() {
            return None;
        }
        Some(self.table[(flow_hash % self.table.len() as u64) as usize] as usize)
    }

    /// Table size (0 when empty).
    pub fn len(&self) -> usize {
        self.table.len()
    }

    /// No backends.
    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Entries per backend index, for tests and status.
    pub fn shares(&self, backends: usize) -> Vec<usize> {
        let mut s = vec![0; backends];
        for &b in self.table.iter() {
            s[b as usize] += 1;
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;

    fn keys(n: usize) -> Vec<String> {
        (0..n)
            .map(|i| format!("198.18.{}.{}:8080", i / 250, i % 250 + 1))
            .collect()
    }

    #[test]
    fn load_is_balanced() {
        let m = Maglev::new(&keys(10), 1021);
        let shares = m.shares(10);
        let (lo, hi) = (*shares.iter().min().unwrap(), *shares.iter().max().unwrap());
        // Maglev guarantees shares within one of each other... up to the permutation tail.
        assert!(hi - lo <= 1, "{shares:?}");
    }

    #[test]
    fn table_size_grows_with_backends_within_the_cap() {
        assert_eq!(table_size_for(1, DEFAULT_TABLE_SIZE), 251);
        assert_eq!(table_size_for(10, DEFAULT_TABLE_SIZE), 1_021);
        assert_eq!(table_size_for(100, DEFAULT_TABLE_SIZE), 16_381);
        assert_eq!(table_size_for(1_000, DEFAULT_TABLE_SIZE), 16_381);
        assert_eq!(table_size_for(10, 509), 509);
        assert!(table_size_for(600, 509) > 600);
    }

    #[test]
    fn empty_has_no_pick() {
        assert_eq!(Maglev::new::<&str>(&[], 7).pick(42), None);
        // A size that is not a prime above the backends is raised, never a panic or a hang.
        for size in [0, 1, 4, 10, 1000] {
            let m = Maglev::new(&keys(10), size);
            assert!(m.pick(1).is_some_and(|i| i < 10), "size {size}");
        }
    }

    proptest! {
        /// Removing one of n backends moves at most the entries it owned plus a small
        /// fraction of the others (the paper's bound; we allow 2 × M/n + 1% of M).
        #[test]
        fn removing_a_backend_disrupts_little(n in 2usize..40, removed in 0usize..40) {
            let removed = removed % n;
            let size = 2_039; // prime
            let all = keys(n);
            let before = Maglev::new(&all, size);
            let mut rest = all.clone();
            rest.remove(removed);
            let after = Maglev::new(&rest, size);
            let mut moved = 0;
            for e in 0..size {
                let b = before.table[e] as usize;
                let a = after.table[e] as usize;
                let a_name = &rest[a];
                if b != removed && &all[b] != a_name {
                    moved += 1;
                }
            }
            let bound = size / n * 2 + size / 100;
            prop_assert!(moved <= bound, "moved {moved} of {size} entries (n={n}), bound {bound}");
        }
    }
}

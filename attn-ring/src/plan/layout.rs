//! How the sequence is split over ranks: contiguous chunks or zigzag (rank `i`
//! holds chunks `i` and `2p-1-i`), for any length (chunk sizes differ by at most one).

use std::ops::Range;

use attn_core::{AttnError, Result};

/// A split of `n` positions over `p` ranks. Every rank's rows are in ascending
/// global order, so local row `j` is the `j`-th position of [`Layout::ranges`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Layout {
    /// Rank `i` holds chunk `i` of `p`.
    #[default]
    Contiguous,
    /// Rank `i` holds chunks `i` and `2p-1-i` of `2p` (balances causal work).
    Zigzag,
}

/// Start of chunk `h` of `2p` balanced chunks of `n` (`h <= 2p`): `floor(h*n / 2p)`,
/// computed as `floor((h/2*n + h%2*floor(n/2)) / p)` in `u128`, which cannot overflow
/// for any `n` and `p` (a zigzag split's `2p` itself may exceed `usize`).
fn chunk_start(n: usize, p: usize, h: u128) -> usize {
    let (n, p) = (n as u128, p as u128);
    ((h / 2 * n + h % 2 * (n / 2)) / p) as usize
}

impl Layout {
    pub fn as_str(self) -> &'static str {
        match self {
            Layout::Contiguous => "contiguous",
            Layout::Zigzag => "zigzag",
        }
    }

    /// Parse `contiguous` / `zigzag`.
    pub fn parse(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "contiguous" | "contig" => Ok(Layout::Contiguous),
            "zigzag" => Ok(Layout::Zigzag),
            _ => Err(AttnError::InvalidArgument(format!("unknown layout `{s}` (contiguous|zigzag)"))),
        }
    }

    /// The global ranges rank `rank` holds, ascending, empty ranges omitted
    /// (none when `rank >= p`).
    pub fn ranges(self, n: usize, p: usize, rank: usize) -> Vec<Range<usize>> {
        if rank >= p {
            return Vec::new();
        }
        let r: Vec<Range<usize>> = match self {
            // Rank `i`'s chunk of `p` is chunks `2i` and `2i + 1` of `2p`.
            Layout::Contiguous => {
                let h = 2 * rank as u128;
                std::iter::once(chunk_start(n, p, h)..chunk_start(n, p, h + 2)).collect()
            }
            Layout::Zigzag => {
                let (a, b) = (rank as u128, 2 * p as u128 - 1 - rank as u128);
                vec![chunk_start(n, p, a)..chunk_start(n, p, a + 1), chunk_start(n, p, b)..chunk_start(n, p, b + 1)]
            }
        };
        let mut out: Vec<Range<usize>> = Vec::with_capacity(2);
        for x in r.into_iter().filter(|x| !x.is_empty()) {
            match out.last_mut() {
                Some(last) if last.end == x.start => last.end = x.end,
                _ => out.push(x),
            }
        }
        out
    }

    /// Number of rows rank `rank` holds.
    pub fn rows(self, n: usize, p: usize, rank: usize) -> usize {
        self.ranges(n, p, rank).iter().map(|r| r.len()).sum()
    }

    /// Global positions of rank `rank`'s rows, in local row order.
    pub fn positions(self, n: usize, p: usize, rank: usize) -> Vec<usize> {
        self.ranges(n, p, rank).into_iter().flatten().collect()
    }

    /// Check that every one of `p` ranks gets at least one of `n` rows.
    pub fn check(self, n: usize, p: usize) -> Result<()> {
        if p == 0 {
            return Err(AttnError::InvalidArgument("world size must be at least 1".into()));
        }
        if let Some(r) = (0..p).find(|&r| self.rows(n, p, r) == 0) {
            return Err(AttnError::InvalidArgument(format!(
                "a sequence of {n} rows split {} over {p} ranks leaves rank {r} empty",
                self.as_str()
            )));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_position_has_exactly_one_owner() {
        for layout in [Layout::Contiguous, Layout::Zigzag] {
            for p in 1..9 {
                for n in 1..50 {
                    let mut all: Vec<usize> = (0..p).flat_map(|r| layout.positions(n, p, r)).collect();
                    all.sort_unstable();
                    assert_eq!(all, (0..n).collect::<Vec<_>>());
                    let sizes: Vec<usize> = (0..p).map(|r| layout.rows(n, p, r)).collect();
                    let (lo, hi) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
                    assert!(hi - lo <= 2, "{layout:?} n={n} p={p} {sizes:?}");
                    assert_eq!(layout.check(n, p).is_ok(), *lo > 0);
                }
            }
        }
        assert_eq!(Layout::Zigzag.ranges(8, 2, 0), vec![0..2, 6..8]);
        assert_eq!(Layout::Zigzag.ranges(8, 2, 1), vec![2..6]);
        assert!(Layout::Zigzag.ranges(8, 2, 2).is_empty() && Layout::Contiguous.ranges(8, 0, 0).is_empty());
        assert!(Layout::Zigzag.check(8, 0).is_err());
    }
}

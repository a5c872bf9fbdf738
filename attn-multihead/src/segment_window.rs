//! Segment windows: the rows an inference pass or a self-attention backward walks a
//! long sequence in, so their buffers hold one window instead of the whole sequence.
//!
//! Every segment of every pattern starts at a multiple of its length (SPEC.md "One
//! pattern"), so a window whose length is a multiple of every segment length, placed at a
//! multiple of its length, holds whole segments: attention never crosses its edges, and
//! the projections, dropout and sub-LayerNorm act per token. Running the layer
//! window by window therefore computes the same function; the last window's shorter
//! segments are the sequence's own shorter last segments, and positions inside a window
//! keep their order, so causal masks agree. What changes is memory: at seq 65536 and
//! embed 512 the fused projection, attention output and sub-LN buffers take 82 MB for an
//! 8192-row window against 671 MB for the whole sequence, and a workspace reused across
//! windows is faulted in (zeroed by the kernel) once instead of for every row.

/// Rows per window unless the layer says otherwise
/// ([`crate::MultiheadDilatedAttention::with_window_rows`]).
pub const DEFAULT_WINDOW_ROWS: usize = 8192;

/// Rows a windowed pass walks `seq` rows in: the smallest multiple of every
/// segment length that is at least `target`. `None` (one pass over the whole sequence)
/// when `target` is 0, when the common multiple overflows, or when one window would
/// cover the whole sequence.
pub(crate) fn window_rows(segment_lengths: &[usize], seq: usize, target: usize) -> Option<usize> {
    if target == 0 {
        return None;
    }
    let lcm = segment_lengths.iter().try_fold(1usize, |acc, &w| {
        if w == 0 {
            return None;
        }
        (acc / gcd(acc, w)).checked_mul(w)
    })?;
    let window = target.div_ceil(lcm).checked_mul(lcm)?;
    (window < seq).then_some(window)
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// `(start, len)` of each window over `seq` rows (the last one may be shorter).
pub(crate) fn windows(seq: usize, window: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..seq).step_by(window.max(1)).map(move |start| (start, window.min(seq - start)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_are_multiples_of_every_segment() {
        assert_eq!(window_rows(&[2048, 4096, 8192], 65536, 8192), Some(8192));
        assert_eq!(window_rows(&[2048, 4096, 8192], 65536, 5000), Some(8192));
        assert_eq!(window_rows(&[2048, 4096, 8192], 65536, 9000), Some(16384));
        assert_eq!(window_rows(&[4, 6], 100, 8), Some(12));
        assert_eq!(window_rows(&[4, 6], 100, 1), Some(12));
        assert_eq!(window_rows(&[3, 5, 7], 1000, 200), Some(210));
    }

    #[test]
    fn no_window_when_disabled_or_covering_the_sequence() {
        assert_eq!(window_rows(&[2048, 4096, 8192], 8192, 8192), None);
        assert_eq!(window_rows(&[2048, 4096, 8192], 8193, 8192), Some(8192));
        assert_eq!(window_rows(&[4], 100, 0), None);
        assert_eq!(window_rows(&[usize::MAX, usize::MAX - 1], 100, 8), None, "lcm overflows");
        assert_eq!(window_rows(&[usize::MAX / 2 + 1], usize::MAX, usize::MAX), None, "window overflows");
        assert_eq!(window_rows(&[0, 4], 100, 8), None);
    }

    #[test]
    fn windows_tile_the_sequence() {
        assert_eq!(windows(10, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4), (8, 2)]);
        assert_eq!(windows(8, 4).collect::<Vec<_>>(), vec![(0, 4), (4, 4)]);
        assert_eq!(windows(3, 4).collect::<Vec<_>>(), vec![(0, 3)]);
    }
}

//! What each rank of a ring case sends and receives, counted from the problem's
//! definition rather than the ring's plan: a rank reads the keys (and values) that
//! share a segment with one of its queries and lie within their reach (a window's
//! `left` before and `right` after a query; causal: none after it), and they travel
//! once per wire pair, a (pattern, key/value head) whose selected rows go to a reader
//! once however many of its query heads read them. Counts are for the all-gather
//! strategy (every row straight from its owner to each rank that reads it).
//!
//! And the closed form of a window: a rank receives at most `left + right` rows
//! (`right` = 0 when causal) per contiguous chunk it holds (one under the contiguous
//! layout, two under zigzag), times key/value heads, batch, 2 (k and v), head_dim and
//! the element size, whatever the sequence length.

use std::ops::Range;

use attn_core::{DType, SegmentPattern};
use attn_ring::RingProblem;

/// Payload bytes (k and v rows; message headers not counted) per rank.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankBytes {
    pub sent: Vec<u64>,
    pub received: Vec<u64>,
}

/// Bytes of one position of one key/value head in k and v over the batch.
fn row_bytes(problem: &RingProblem, dtype: DType) -> u64 {
    (problem.batch * 2 * problem.head_dim * dtype.size()) as u64
}

/// The wire pairs: every (pattern index, key/value head, pattern) some query head reads.
fn wire_pairs(problem: &RingProblem) -> Vec<SegmentPattern> {
    let group = problem.group();
    let mut pairs: Vec<(usize, usize, SegmentPattern)> = Vec::new();
    for h in 0..problem.heads {
        for (i, pat) in problem.cfg.head_patterns(problem.heads, h).patterns {
            if !pairs.contains(&(i, h / group, pat)) {
                pairs.push((i, h / group, pat));
            }
        }
    }
    pairs.into_iter().map(|(_, _, pat)| pat).collect()
}

/// The keys the queries `chunk` may read under `pat`: the segments the chunk touches,
/// within the config's reach of its first and last query.
fn needed(problem: &RingProblem, pat: &SegmentPattern, chunk: &Range<usize>) -> Range<usize> {
    let n = problem.seq;
    let span = pat.segment_bounds(pat.segment_of(chunk.start), n).start
        ..pat.segment_bounds(pat.segment_of(chunk.end - 1), n).end;
    let reach = problem.cfg.band().keys_of_queries(chunk.start, chunk.end - 1);
    span.start.max(reach.start)..span.end.min(reach.end).min(n)
}

/// Merge overlapping or touching ranges.
fn merged(mut v: Vec<Range<usize>>) -> Vec<Range<usize>> {
    v.sort_by_key(|r| r.start);
    let mut out: Vec<Range<usize>> = Vec::new();
    for r in v {
        match out.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => out.push(r),
        }
    }
    out
}

/// Rows (positions x wire pairs) owner `o` sends rank `r`.
fn rows_between(
    problem: &RingProblem,
    pairs: &[SegmentPattern],
    chunks: &[Vec<Range<usize>>],
    o: usize,
    r: usize,
) -> u64 {
    pairs
        .iter()
        .map(|pat| {
            let regions = chunks[r]
                .iter()
                .map(|b| needed(problem, pat, b))
                .flat_map(|want| chunks[o].iter().map(move |a| a.start.max(want.start)..a.end.min(want.end)))
                .filter(|x| x.start < x.end)
                .collect();
            merged(regions).into_iter().map(|x| pat.count_in_range(x) as u64).sum::<u64>()
        })
        .sum()
}

/// Payload bytes each rank sends and receives in one forward call of `problem`.
pub fn counted(problem: &RingProblem, dtype: DType) -> RankBytes {
    let (n, p) = (problem.seq, problem.world);
    let chunks: Vec<Vec<Range<usize>>> = (0..p).map(|r| problem.layout.ranges(n, p, r)).collect();
    let pairs = wire_pairs(problem);
    let rb = row_bytes(problem, dtype);
    // bytes[o][r]: what owner `o` sends rank `r`.
    let bytes: Vec<Vec<u64>> = (0..p)
        .map(|o| (0..p).map(|r| if o == r { 0 } else { rows_between(problem, &pairs, &chunks, o, r) * rb }).collect())
        .collect();
    RankBytes {
        sent: bytes.iter().map(|row| row.iter().sum()).collect(),
        received: (0..p).map(|r| bytes.iter().map(|row| row[r]).sum()).collect(),
    }
}

/// The window bound per rank: `(left + right) x chunks x kv_heads` rows (`right` = 0
/// when causal) of `row_bytes`; `None` for a dilated config.
pub fn window_bound(problem: &RingProblem, dtype: DType) -> Option<Vec<u64>> {
    let w = problem.cfg.window()?;
    let reach = (w.left + if problem.cfg.causal() { 0 } else { w.right }) as u64;
    let (n, p) = (problem.seq, problem.world);
    let per_chunk = reach * problem.kv_heads as u64 * row_bytes(problem, dtype);
    Some((0..p).map(|r| problem.layout.ranges(n, p, r).len() as u64 * per_chunk).collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    use attn_core::{AttnShape, DilatedConfig, Mixing, Shape4, TensorName, TensorView};
    use attn_ring::{Layout, Strategy, ThreadComm, run_problem_on};

    use crate::inputs::normal_vec;

    fn problem(cfg: &DilatedConfig, seq: usize, kv_heads: usize, layout: Layout, world: usize) -> RingProblem {
        let q = Shape4::new(2, seq, 4, 8).unwrap();
        let shape = AttnShape { q, kv: Shape4 { heads: kv_heads, ..q } };
        RingProblem::new(cfg, shape, layout, Strategy::AllGather, world)
    }

    /// A real in-process run sends exactly the counted payload from every rank (its
    /// data bytes less a 9-byte header per message), windows and grouped dilated heads,
    /// causal or not, both layouts.
    #[test]
    fn counts_equal_what_a_ring_run_sends() {
        let dilated = |mixing, causal: bool| {
            DilatedConfig::builder()
                .segments(&[16, 64, 128])
                .dilations(&[1, 2, 4])
                .mixing(mixing)
                .causality(causal.into())
        };
        let configs = [
            DilatedConfig::builder().window(21, 0).causal().build().unwrap(),
            DilatedConfig::builder().window(9, 14).build().unwrap(),
            dilated(Mixing::HeadGroups, false).build().unwrap(),
            dilated(Mixing::HeadGroups, true).build().unwrap(),
            dilated(Mixing::LongNet, false).build().unwrap(),
        ];
        for cfg in &configs {
            for kv_heads in [1, 2, 4] {
                for layout in [Layout::Contiguous, Layout::Zigzag] {
                    for world in [2, 3, 4] {
                        let problem = problem(cfg, 160, kv_heads, layout, world);
                        let shape = AttnShape {
                            q: Shape4::new(2, 160, 4, 8).unwrap(),
                            kv: Shape4::new(2, 160, kv_heads, 8).unwrap(),
                        };
                        let (q, k, v) = (
                            normal_vec::<f32>(1, shape.q.numel()),
                            normal_vec(2, shape.kv.numel()),
                            normal_vec(3, shape.kv.numel()),
                        );
                        let views = [
                            TensorView::contiguous(TensorName::Query, &q, shape.q).unwrap(),
                            TensorView::contiguous(TensorName::Key, &k, shape.kv).unwrap(),
                            TensorView::contiguous(TensorName::Value, &v, shape.kv).unwrap(),
                        ];
                        let run = run_problem_on(ThreadComm::world(world).unwrap(), &problem, views).unwrap();
                        let measured: Vec<u64> =
                            run.stats.iter().map(|s| s.data_bytes_sent - 9 * s.data_messages).collect();
                        let c = counted(&problem, DType::F32);
                        let case = format!("{cfg:?} kv={kv_heads} {layout:?} p={world}");
                        assert_eq!(measured, c.sent, "{case}");
                        assert_eq!(c.sent.iter().sum::<u64>(), c.received.iter().sum::<u64>(), "{case}");
                    }
                }
            }
        }
    }

    /// Every rank receives at most the window bound, the middle ranks of the contiguous
    /// layout exactly that, and the bound does not grow with the sequence. Chunks
    /// shorter than the window may send more than it: each later chunk in reach reads them.
    #[test]
    fn windows_stay_within_the_bound_at_every_length() {
        for (left, right, causal) in [(40, 0, true), (40, 8, false), (40, 8, true)] {
            let cfg = DilatedConfig::builder().window(left, right).causality(causal.into()).build().unwrap();
            let mut bounds = Vec::new();
            for seq in [1024, 8192, 65536] {
                for layout in [Layout::Contiguous, Layout::Zigzag] {
                    let p = problem(&cfg, seq, 2, layout, 4);
                    let (c, bound) = (counted(&p, DType::BF16), window_bound(&p, DType::BF16).unwrap());
                    for (r, (got, b)) in c.received.iter().zip(&bound).enumerate() {
                        assert!(got <= b, "{seq} {layout:?} rank {r}");
                    }
                    if layout == Layout::Contiguous {
                        assert_eq!(c.received[1], bound[1], "{seq}: a middle rank reads its whole reach");
                        bounds.push(bound);
                    }
                }
            }
            assert!(bounds.windows(2).all(|b| b[0] == b[1]), "{bounds:?}");
            let reach = (left + if causal { 0 } else { right }) as u64;
            assert_eq!(bounds[0][0], reach * 2 * 2 * 2 * 8 * 2, "reach x kv heads x batch x (k, v) x d x bf16");
        }
        let dilated = DilatedConfig::new(&[16], &[1]).unwrap();
        assert!(window_bound(&problem(&dilated, 64, 4, Layout::Contiguous, 2), DType::F32).is_none());
        // Chunks of 16 under a causal window of 40: a middle chunk's rows reach the next three chunks.
        let cfg = DilatedConfig::builder().window(40, 0).causal().build().unwrap();
        let p = problem(&cfg, 64, 1, Layout::Contiguous, 4);
        let (c, bound) = (counted(&p, DType::F32), window_bound(&p, DType::F32).unwrap());
        let row = 2 * 2 * 8 * 4;
        assert_eq!((c.sent[0] / row, c.received[3] / row, bound[3] / row), (16 + 16 + 8, 40, 40));
    }

    /// One key/value head sends each pattern's rows once: grouped heads under head
    /// groups send `patterns` pairs where 4 key/value heads send one per head.
    #[test]
    fn grouped_heads_count_each_pair_once() {
        let cfg = DilatedConfig::new(&[32, 128], &[1, 2]).unwrap();
        let one = problem(&cfg, 256, 1, Layout::Contiguous, 4);
        let four = problem(&cfg, 256, 4, Layout::Contiguous, 4);
        assert_eq!(wire_pairs(&one).len(), 2);
        assert_eq!(wire_pairs(&four).len(), 4);
        // Only the 128-segment pattern spans ranks: 2 of the 4 heads read it, 1 pair of 1.
        let (a, b) = (counted(&one, DType::F32), counted(&four, DType::F32));
        assert!(a.sent.iter().zip(&b.sent).all(|(x, y)| 2 * x == *y), "{a:?} {b:?}");
    }
}

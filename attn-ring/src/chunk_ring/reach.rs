//! Which blocks of the chunk ring can hold an attended (query, key) pair. None can when the
//! band keeps the keys out of every query's reach, when no packed sequence holds rows of
//! both, or when no pattern has a segment holding rows of both; the protocol skips such
//! blocks (their result is empty), so a causal or segment-local ring computes only the
//! blocks that matter, and each round's k/v slices travel only as far as the farthest rank
//! reaching them (a window's slices away from the chunk's edge not at all).

use std::ops::Range;

use super::{rank_pieces, round_slices};
use crate::plan::ring_route::route;
use crate::plan::{RingProblem, Strategy};

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    a.start < b.end && b.start < a.end
}

/// Whether some query in `q` may attend some key in `k` (global positions); `false` only
/// when no pair is admitted by any pattern, head or mask.
pub(crate) fn may_attend(problem: &RingProblem, q: &Range<usize>, k: &Range<usize>) -> bool {
    if q.is_empty() || k.is_empty() {
        return false;
    }
    let reach = problem.cfg.band().keys_of_queries(q.start, q.end - 1);
    if !overlaps(&reach, k) {
        return false;
    }
    let both = |s: &Range<usize>| overlaps(s, q) && overlaps(s, k);
    let windowed = problem.cfg.window().is_some();
    // Segments restart at each sequence: compare segment indices of relative positions.
    let shares_segment = |s: &Range<usize>| {
        let rel = |r: &Range<usize>| (r.start.max(s.start) - s.start, r.end.min(s.end) - s.start - 1);
        let ((qa, qb), (ka, kb)) = (rel(q), rel(k));
        windowed || problem.cfg.segment_lengths().iter().any(|&w| qa / w <= kb / w && ka / w <= qb / w)
    };
    match problem.masks.cu_seqlens() {
        Some(cu) => cu.windows(2).map(|w| w[0]..w[1]).any(|s| both(&s) && shares_segment(&s)),
        None => shares_segment(&(0..problem.seq)),
    }
}

/// The ring distances `d` (`1..world`, ascending) at which some rank's queries may attend
/// the keys `keys[o]` of the rank `o` that is `d` before it.
fn reach_distances(problem: &RingProblem, keys: &[Vec<Range<usize>>]) -> Vec<usize> {
    let p = problem.world;
    let queries: Vec<Vec<Range<usize>>> = (0..p).map(|r| rank_pieces(problem, r)).collect();
    let reaches = |r: usize, o: usize| queries[r].iter().any(|q| keys[o].iter().any(|k| may_attend(problem, q, k)));
    (1..p).filter(|&d| (0..p).any(|r| reaches(r, (r + p - d) % p))).collect()
}

/// One trip of a round's k/v slices from their owner: `steps` travels of `hop` ranks each
/// (1: to the next rank; `world - 1`: to the previous one), every rank on the way passing
/// on what it holds; the backward's dk/dv then go straight home.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Trip {
    pub hop: usize,
    pub steps: usize,
}

/// The trips of round `round` (of `rounds`) under `problem`'s strategy, for the distances
/// at which some rank's queries reach that round's k/v slices. [`Strategy::Ring`]: a trip
/// each way, routed as the plan ring routes a block ([`route`]: the nearer distances
/// reached going to the next rank, the farther ones going back; a two-sided window one
/// step each way, segments inside ranks no step). [`Strategy::AllGather`]: one step
/// straight to the rank each needed distance away. [`Strategy::Auto`]: straight where that
/// takes fewer travels than the ring's steps (distances with gaps), else along the ring.
/// Every rank computes the same trips from the problem alone.
pub(crate) fn chunk_trips(problem: &RingProblem, round: usize, rounds: usize) -> Vec<Trip> {
    let keys: Vec<Vec<Range<usize>>> = (0..problem.world)
        .map(|o| round_slices(problem, o, round, rounds).iter().map(|s| s.start..s.start + s.rows.len()).collect())
        .collect();
    trips_for(problem.strategy, &reach_distances(problem, &keys), problem.world)
}

fn trips_for(strategy: Strategy, dists: &[usize], world: usize) -> Vec<Trip> {
    let rt = route(dists, world);
    let ring = [Trip { hop: 1, steps: rt.next }, Trip { hop: world.saturating_sub(1), steps: rt.prev }];
    let ring = ring.into_iter().filter(|t| t.steps > 0).collect();
    let direct = dists.iter().map(|&d| Trip { hop: d, steps: 1 }).collect();
    match strategy {
        Strategy::Ring => ring,
        Strategy::AllGather => direct,
        // The head strategies run their own exchange (`heads`): here they read as `Auto`.
        Strategy::Auto | Strategy::Ulysses | Strategy::Hybrid { .. } if dists.len() < rt.next + rt.prev => direct,
        Strategy::Auto | Strategy::Ulysses | Strategy::Hybrid { .. } => ring,
    }
}

#[cfg(test)]
mod tests {
    use attn_core::{DilatedConfig, Shape4};
    use proptest::prelude::*;

    use super::*;
    use crate::Layout;
    use crate::plan::Strategy;
    use attn_core::OwnedMasks;

    /// Brute force: a pair in one sequence, admitted by the band, in one segment of some
    /// pattern (selection aside, so a superset of the attended pairs).
    fn some_pair(problem: &RingProblem, q: &Range<usize>, k: &Range<usize>) -> bool {
        let cfg = &problem.cfg;
        let seq_of = |p: usize| match problem.masks.cu_seqlens() {
            Some(cu) => cu.partition_point(|&c| c <= p) - 1,
            None => 0,
        };
        let start = |p: usize| problem.masks.cu_seqlens().map_or(0, |cu| cu[seq_of(p)]);
        q.clone().any(|qp| {
            k.clone().any(|kp| {
                seq_of(qp) == seq_of(kp)
                    && cfg.band().admits(qp, kp)
                    && (cfg.window().is_some()
                        || cfg.segment_lengths().iter().any(|&w| (qp - start(qp)) / w == (kp - start(kp)) / w))
            })
        })
    }

    proptest! {
        #[test]
        fn a_skipped_block_holds_no_admitted_pair(
            seq in 8usize..80,
            segs in prop::sample::select(vec![vec![4usize], vec![4, 8], vec![6, 12, 24], vec![16, 40]]),
            causal: bool,
            window in prop::option::of((0usize..12, 0usize..12)),
            cuts in prop::collection::vec(1usize..80, 0..4),
            (qa, qn, ka, kn) in (0usize..80, 1usize..30, 0usize..80, 1usize..30),
        ) {
            let mut b = DilatedConfig::builder();
            b = match window {
                Some((l, r)) => b.window(l, if causal { 0 } else { r }),
                None => b.segments(&segs).dilations(&vec![1; segs.len()]).causality(causal.into()),
            };
            let cfg = b.build().unwrap();
            let shape = Shape4::new(1, seq, 2, 4).unwrap();
            let mut cu: Vec<usize> = cuts.into_iter().filter(|&c| c < seq).collect();
            cu.extend([0, seq]);
            cu.sort_unstable();
            cu.dedup();
            let masks = match cu.len() > 2 {
                true => OwnedMasks::none().with_cu_seqlens(cu).unwrap(),
                false => OwnedMasks::none(),
            };
            let problem = RingProblem::new(&cfg, shape.into(), Layout::Contiguous, Strategy::Auto, 1).with_masks(masks);
            let (q, k) = (qa.min(seq)..(qa + qn).min(seq), ka.min(seq)..(ka + kn).min(seq));
            if some_pair(&problem, &q, &k) {
                prop_assert!(may_attend(&problem, &q, &k), "{q:?} {k:?} {:?}", problem.masks);
            }
        }
    }

    #[test]
    fn keys_travel_only_as_far_as_the_queries_reaching_them() {
        let trips = |cfg: &DilatedConfig, layout, strategy| {
            let shape = Shape4::new(1, 64, 1, 4).unwrap().into();
            chunk_trips(&RingProblem::new(cfg, shape, layout, strategy, 4), 0, 1)
        };
        // (steps to the next rank, steps back) under the ring strategy.
        let route_of = |cfg: DilatedConfig, layout| {
            let t = trips(&cfg, layout, Strategy::Ring);
            let steps = |hop| t.iter().filter(|x| x.hop == hop).map(|x| x.steps).sum::<usize>();
            (steps(1), steps(3))
        };
        let local = DilatedConfig::builder().segments(&[16]).dilations(&[1]).build().unwrap();
        assert_eq!(route_of(local, Layout::Contiguous), (0, 0), "segments inside ranks");
        let window = DilatedConfig::builder().window(5, 0).causal().build().unwrap();
        assert_eq!(route_of(window.clone(), Layout::Contiguous), (1, 0), "causal window");
        assert_eq!(route_of(window, Layout::Zigzag), (1, 1), "zigzag: the later chunk's keys are on the next rank");
        let two_sided = DilatedConfig::builder().window(5, 5).build().unwrap();
        assert_eq!(route_of(two_sided.clone(), Layout::Contiguous), (1, 1), "both neighbours");
        let dense = DilatedConfig::builder().segments(&[64]).dilations(&[1]).causal().build().unwrap();
        assert_eq!(route_of(dense.clone(), Layout::Contiguous), (3, 0), "every rank before: one way round");
        // All-gather: straight to each distance; auto takes it only where it saves steps.
        let one = |hop| Trip { hop, steps: 1 };
        assert_eq!(trips(&two_sided, Layout::Contiguous, Strategy::AllGather), vec![one(1), one(3)]);
        assert_eq!(trips(&two_sided, Layout::Contiguous, Strategy::Auto), vec![one(1), one(3)]);
        assert_eq!(trips(&dense, Layout::Contiguous, Strategy::Auto), vec![Trip { hop: 1, steps: 3 }]);
        // Keys two ranks back only: one straight travel instead of two ring steps.
        assert_eq!(trips_for(Strategy::Auto, &[2], 4), vec![one(2)]);
        assert_eq!(trips_for(Strategy::Ring, &[2], 4), vec![Trip { hop: 1, steps: 2 }]);
    }

    /// In rounds, a slice travels only where queries reach it: a causal window of 3 over
    /// 16-row chunks in 4 rounds reaches the previous rank's last slice only.
    #[test]
    fn each_round_travels_as_far_as_its_own_slices_are_reached() {
        let shape = Shape4::new(1, 64, 1, 4).unwrap().into();
        let window = DilatedConfig::builder().window(3, 0).causal().build().unwrap();
        let problem = RingProblem::new(&window, shape, Layout::Contiguous, Strategy::Ring, 4);
        let per_round: Vec<Vec<Trip>> = (0..4).map(|round| chunk_trips(&problem, round, 4)).collect();
        assert_eq!(per_round, [vec![], vec![], vec![], vec![Trip { hop: 1, steps: 1 }]]);
        // Dense causal attention needs every slice on every later rank.
        let dense = DilatedConfig::builder().segments(&[64]).dilations(&[1]).causal().build().unwrap();
        let problem = RingProblem::new(&dense, shape, Layout::Contiguous, Strategy::Ring, 4);
        for round in 0..4 {
            assert_eq!(chunk_trips(&problem, round, 4), [Trip { hop: 1, steps: 3 }], "round {round}");
        }
    }

    #[test]
    fn blocks_out_of_reach_are_skipped() {
        let cfg = DilatedConfig::builder().segments(&[8]).dilations(&[1]).causal().build().unwrap();
        let problem =
            RingProblem::new(&cfg, Shape4::new(1, 32, 1, 4).unwrap().into(), Layout::Contiguous, Strategy::Auto, 4);
        assert!(!may_attend(&problem, &(0..8), &(8..16)), "keys after every query");
        assert!(!may_attend(&problem, &(16..24), &(0..8)), "another segment");
        assert!(may_attend(&problem, &(8..16), &(8..16)));
    }
}

//! The chunk ring's backward with a gradient into the LSE (CPU compute): random feature
//! cases on world sizes 1..=6, both layouts, both transports, and rows that attend nothing
//! (a NaN gradient on them) in f32, bf16 and f16, each against the float64 reference; a
//! misfit gradient on one rank is every rank's error naming it, and per-row pieces round-trip.

use crate::chunk_ring::small_problem;
use crate::common;

use std::marker::PhantomData;
use std::time::Duration;

use attn_core::{AttnError, Element, Shape4};
use attn_ring::chunk_ring::{ChunkCompute, ChunkOptions, CpuChunks, HostTransport, chunk_backward, rank_pieces};
use attn_ring::{Layout, Strategy, ThreadComm};
use attn_testkit::{feature_case, judge_lse_gradients, unattended_rows_case};
use common::{ChunkBackend, Moves};
use half::{bf16, f16};
use proptest::prelude::*;

const TIMEOUT: Duration = Duration::from_secs(20);

fn chunk<T>(
    world: usize,
    layout: Layout,
    moves: Moves,
) -> ChunkBackend<T, impl Fn(usize) -> attn_core::Result<Vec<ThreadComm>>> {
    ChunkBackend {
        label: "threads",
        world,
        layout,
        strategy: Strategy::Auto,
        join: |p| ThreadComm::world_with_timeout(p, TIMEOUT),
        moves,
        opts: ChunkOptions::default(),
        compute: CpuChunks::default(),
        dtype: PhantomData,
    }
}

proptest! {
    #![proptest_config(ProptestConfig { cases: attn_testkit::proptest_cases(48), max_shrink_iters: 32, ..ProptestConfig::default() })]

    #[test]
    fn lse_gradients_through_the_chunk_ring_match_the_reference(
        case in feature_case(1..=40, 16, vec![1, 4, 8]),
        world in 1usize..=6,
        zigzag in any::<bool>(),
        in_process in any::<bool>(),
    ) {
        let layout = if zigzag { Layout::Zigzag } else { Layout::Contiguous };
        prop_assume!(layout.check(case.shape.q.seq, world).is_ok());
        let moves = if in_process { Moves::InProcess } else { Moves::HostStaged };
        let verdict = judge_lse_gradients(&chunk::<f32>(world, layout, moves), &case);
        prop_assert!(verdict.is_ok(), "{}", verdict.unwrap_err());
    }
}

fn judge_unattended<T: Element>(world: usize, layout: Layout) {
    let case = unattended_rows_case();
    if let Err(e) = judge_lse_gradients(&chunk::<T>(world, layout, Moves::HostStaged), &case) {
        panic!("{} world {world} {layout:?}: {e}", T::DTYPE.as_str());
    }
}

#[test]
fn rows_that_attend_nothing_take_no_lse_gradient() {
    let seq = unattended_rows_case().shape.q.seq;
    let mut runs = 0;
    for world in 1..=4 {
        for layout in [Layout::Contiguous, Layout::Zigzag] {
            if layout.check(seq, world).is_err() {
                continue;
            }
            judge_unattended::<f32>(world, layout);
            judge_unattended::<bf16>(world, layout);
            judge_unattended::<f16>(world, layout);
            runs += 1;
        }
    }
    assert!(runs >= 4, "only {runs} world sizes and layouts fit the case");
}

#[test]
fn a_misfit_lse_gradient_on_one_rank_fails_every_rank_naming_it() {
    let (problem, pieces) = small_problem(3);
    let compute = CpuChunks::default();
    let comms = ThreadComm::world_with_timeout(3, TIMEOUT).unwrap();
    let results: Vec<attn_core::Result<()>> = std::thread::scope(|s| {
        let hs: Vec<_> = comms
            .into_iter()
            .zip(&pieces)
            .enumerate()
            .map(|(rank, (mut comm, [q, k, v]))| {
                let (problem, compute) = (&problem, &compute);
                s.spawn(move || {
                    // One piece of per-row values for each query piece; rank 1's rows one short.
                    let grad_lse = rank_pieces(problem, rank)
                        .into_iter()
                        .map(|r| {
                            let rows = if rank == 1 { r.len() - 1 } else { r.len() };
                            let shape = Shape4 { batch: 1, seq: rows, heads: 2, head_dim: 1 };
                            ChunkCompute::<f32>::stats_from_bsh(compute, shape, &vec![0.5; 2 * rows])
                        })
                        .collect::<attn_core::Result<Vec<_>>>()?;
                    let mut t = HostTransport::new(&mut comm);
                    let opts = ChunkOptions::default();
                    chunk_backward(&mut t, compute, problem, opts, [q, k, v], q, Some(&grad_lse)).map(|_| ())
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    for (rank, r) in results.iter().enumerate() {
        match r {
            Err(AttnError::RankDisagreement(m)) => {
                assert!(m.contains("grad_lse pieces have shapes"), "rank {rank}: {m}")
            }
            other => panic!("rank {rank}: {other:?}"),
        }
    }
}

#[test]
fn per_row_values_round_trip_and_misfits_are_refused() {
    let x = CpuChunks::default();
    let shape = Shape4 { batch: 2, seq: 3, heads: 2, head_dim: 5 };
    let values: Vec<f32> = (0..12).map(|i| i as f32).collect();
    let stats = ChunkCompute::<f32>::stats_from_bsh(&x, shape, &values).unwrap();
    assert_eq!(stats.to_bsh(), values);
    assert_eq!(ChunkCompute::<f32>::stats_shape(&x, &stats), Some(Shape4 { head_dim: 1, ..shape }));
    let e = ChunkCompute::<f32>::stats_from_bsh(&x, shape, &values[1..]).unwrap_err();
    assert!(matches!(e, AttnError::InvalidArgument(ref m) if m.contains("11 per-row values")), "{e}");
    let mut ragged = stats.clone();
    ragged.data[1].pop();
    assert_eq!(ChunkCompute::<f32>::stats_shape(&x, &ragged), None);
}

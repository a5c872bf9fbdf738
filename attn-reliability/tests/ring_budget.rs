//! Ring memory budgets: `Plan::workspace_bytes` bounds what each rank allocates in
//! `ring_forward` / `ring_backward` (the per-thread counting allocator charges a frame
//! freed by its receiver back to its sender), and a `RingOptions` budget below
//! `ring_workspace_bytes` is refused on every rank with `OverBudget`, before anything
//! proportional to the problem is allocated or sent, with the outputs untouched.

use std::time::Duration;

use attn_core::error::TensorName;
use attn_core::{AttnError, DType, DilatedConfig, Element, MemoryBudget, Mixing, Result, Shape4, TensorView};
use attn_core::{Pass, TensorViewMut};
use attn_reliability::counting_alloc::{self, CountingAlloc, measure_thread, new_thread_epoch};
use attn_reliability::watchdog::within;
use attn_ring::{BackwardOutputs, Communicator, Layout, Plan, RingOptions, RingProblem, Strategy, ThreadComm};
use attn_ring::{local_rows, problem_for, ring_backward_with, ring_forward_with, ring_workspace_bytes};
use attn_testkit::rng::random_vec;
use half::bf16;

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const WATCHDOG: Duration = Duration::from_secs(240);

fn cfg(w: &[usize], r: &[usize], mixing: Mixing, causal: bool) -> DilatedConfig {
    DilatedConfig::builder().segments(w).dilations(r).mixing(mixing).causality(causal.into()).build().unwrap()
}

/// (config, global shape): segment-local and spanning patterns, plain ring attention,
/// odd sizes.
fn cases() -> Vec<(DilatedConfig, Shape4)> {
    vec![
        (cfg(&[8, 32, 32], &[1, 2, 4], Mixing::LongNet, true), Shape4::new(1, 64, 2, 8).unwrap()),
        (cfg(&[16, 64, 256], &[1, 2, 4], Mixing::HeadGroups, false), Shape4::new(2, 256, 3, 16).unwrap()),
        (cfg(&[512], &[1], Mixing::HeadGroups, false), Shape4::new(1, 512, 2, 32).unwrap()),
        (cfg(&[64, 256, 1024], &[1, 4, 16], Mixing::LongNet, true), Shape4::new(1, 1024, 4, 64).unwrap()),
        (cfg(&[10, 30], &[3, 2], Mixing::LongNet, false), Shape4::new(2, 61, 3, 5).unwrap()),
        // The bench's capacity configuration at a smaller scale.
        (cfg(&[512, 1024, 2048], &[1, 2, 4], Mixing::HeadGroups, false), Shape4::new(1, 4096, 8, 64).unwrap()),
    ]
}

const VARIANTS: [(Layout, Strategy); 4] = [
    (Layout::Contiguous, Strategy::Auto),
    (Layout::Contiguous, Strategy::Ring),
    (Layout::Zigzag, Strategy::AllGather),
    (Layout::Zigzag, Strategy::Ring),
];

/// What one rank returned: its outputs (out + lse, or dq + dk + dv, as f32) and the
/// peak bytes it allocated during the call.
type RankRun = (Result<Vec<f32>>, usize);

/// Run `problem` on in-process ranks with `opts[rank]`, outputs pre-filled with 7.0;
/// each rank's outputs (also on error: they must then still be 7.0) and peak bytes.
fn run<T: Element>(problem: &RingProblem, opts: &[RingOptions], backward: bool, seed: u64) -> Vec<RankRun> {
    let s = Shape4::new(problem.batch, problem.seq, problem.heads, problem.head_dim).unwrap();
    let global: Vec<Vec<T>> =
        (0..4).map(|i| random_vec(seed + i, s.numel()).into_iter().map(T::from_f32).collect()).collect();
    let comms = ThreadComm::world_with_timeout(problem.world, Duration::from_secs(30)).unwrap();
    new_thread_epoch();
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|mut comm| {
                let (global, opts) = (&global, opts[comm.rank()]);
                scope.spawn(move || -> RankRun {
                    let pos = problem.layout.positions(problem.seq, problem.world, comm.rank());
                    let ls = s.with_seq(pos.len()).unwrap();
                    let local: Vec<Vec<T>> = global
                        .iter()
                        .map(|g| {
                            local_rows(&TensorView::contiguous(TensorName::Other("g"), g, s).unwrap(), &pos).unwrap()
                        })
                        .collect();
                    let view = |i: usize| TensorView::contiguous(TensorName::Other("in"), &local[i], ls).unwrap();
                    let qkv = [view(0), view(1), view(2)];
                    let mut outs = [0; 3].map(|_| vec![T::from_f32(7.0); ls.numel()]);
                    let mut lse = vec![7.0f32; ls.lse_len()];
                    let (r, peak) = if backward {
                        let [a, b, c] = &mut outs;
                        let m = |x| TensorViewMut::contiguous(TensorName::Other("grad"), x, ls).unwrap();
                        let (mut dq, mut dk, mut dv) = (m(a), m(b), m(c));
                        let g = BackwardOutputs { dq: &mut dq, dk: &mut dk, dv: &mut dv };
                        measure_thread(|| ring_backward_with(&mut comm, problem, &opts, qkv, view(3), None, g))
                    } else {
                        let mut ov = TensorViewMut::contiguous(TensorName::Output, &mut outs[0], ls).unwrap();
                        let [q, k, v] = qkv;
                        measure_thread(|| ring_forward_with(&mut comm, problem, &opts, [q, k, v], &mut ov, &mut lse))
                    };
                    let n = if backward { 3 } else { 1 };
                    let mut flat: Vec<f32> = outs[..n].iter().flatten().map(|x| x.to_f32()).collect();
                    if !backward {
                        flat.extend_from_slice(&lse);
                    }
                    match r {
                        Ok(_) => (Ok(flat), peak),
                        Err(e) => {
                            assert!(
                                flat.iter().all(|&x| x == 7.0),
                                "rank {} wrote outputs before failing",
                                comm.rank()
                            );
                            (Err(e), peak)
                        }
                    }
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread panicked")).collect()
    })
}

/// Worst and best measured/bound ratio over every rank of every run.
#[derive(Debug, Default)]
struct Ratios {
    runs: usize,
    worst: f64,
    best: f64,
}

impl Ratios {
    fn add(&mut self, got: usize, bound: u64) {
        let r = got as f64 / bound as f64;
        self.worst = self.worst.max(r);
        self.best = if self.runs == 0 { r } else { self.best.min(r) };
        self.runs += 1;
    }
}

fn check_bound<T: Element>(dtype: DType, worlds: &[usize], ratios: &mut Ratios) {
    for (cfg, shape) in cases() {
        for &world in worlds {
            for (layout, strategy) in VARIANTS {
                if layout.check(shape.seq, world).is_err() {
                    continue;
                }
                bound_one::<T>(&problem_for(&cfg, shape, layout, strategy, world), dtype, ratios);
            }
        }
    }
}

/// Every rank's peak allocation of `problem`'s forward and backward within its
/// `workspace_bytes`.
fn bound_one<T: Element>(problem: &RingProblem, dtype: DType, ratios: &mut Ratios) {
    let (world, layout, strategy, shape) = (problem.world, problem.layout, problem.strategy, problem.seq);
    let plan = Plan::new(problem.clone()).unwrap();
    for backward in [false, true] {
        let pass = if backward { Pass::Backward } else { Pass::Forward };
        let res = run::<T>(problem, &vec![RingOptions::default(); world], backward, 5);
        for (rank, (r, got)) in res.into_iter().enumerate() {
            r.unwrap_or_else(|e| panic!("{problem:?} rank {rank}: {e}"));
            let bound = plan.workspace_bytes(dtype, rank, pass);
            assert!(
                got as u64 <= bound,
                "{} rank {rank} of {world} ({layout:?}, {strategy:?}, seq {shape}, {dtype:?}): allocated {got} \
                 bytes, workspace_bytes says {bound}",
                if backward { "backward" } else { "forward" },
            );
            ratios.add(got, bound);
        }
    }
}

/// The head strategies' bound (`heads_workspace_bytes`): Ulysses at 2 and 4 ranks and the
/// hybrid with groups of 2 at 4, both layouts, where the heads allow the degree.
#[test]
fn workspace_bytes_bound_the_head_strategies() {
    let _g = counting_alloc::exclusive();
    let ratios = within(WATCHDOG, || {
        let mut ratios = Ratios::default();
        for (cfg, shape) in cases() {
            for (world, strategy) in
                [(2, Strategy::Ulysses), (4, Strategy::Ulysses), (4, Strategy::Hybrid { ulysses: 2 })]
            {
                if shape.heads < strategy.ulysses_degree(world).unwrap_or(world) {
                    continue;
                }
                for layout in [Layout::Contiguous, Layout::Zigzag] {
                    bound_one::<f32>(&problem_for(&cfg, shape, layout, strategy, world), DType::F32, &mut ratios);
                }
            }
        }
        ratios
    })
    .expect("budget runs hung");
    assert!(ratios.runs >= 60, "{ratios:?}");
    eprintln!("{} rank-calls: measured / workspace_bytes from {:.3} to {:.3}", ratios.runs, ratios.best, ratios.worst);
}

#[test]
fn workspace_bytes_bound_what_every_rank_allocates() {
    let _g = counting_alloc::exclusive();
    let ratios = within(WATCHDOG, || {
        let mut ratios = Ratios::default();
        check_bound::<f32>(DType::F32, &[1, 2, 4, 8], &mut ratios);
        check_bound::<bf16>(DType::BF16, &[4], &mut ratios);
        ratios
    })
    .expect("budget runs hung");
    eprintln!("{} rank-calls: measured / workspace_bytes from {:.3} to {:.3}", ratios.runs, ratios.best, ratios.worst);
}

#[test]
fn a_ring_call_over_budget_is_refused_on_every_rank() {
    let _g = counting_alloc::exclusive();
    let (refusals, most) = within(WATCHDOG, || {
        let (mut refusals, mut most) = (0, 0);
        // The small cases (the last, larger one is covered by the bound test).
        for (cfg, shape) in cases().into_iter().take(5) {
            for (world, (layout, strategy)) in [(4, VARIANTS[0]), (2, VARIANTS[2]), (8, VARIANTS[3])] {
                if layout.check(shape.seq, world).is_err() {
                    continue;
                }
                let problem = problem_for(&cfg, shape, layout, strategy, world);
                for backward in [false, true] {
                    let pass = if backward { Pass::Backward } else { Pass::Forward };
                    let need = ring_workspace_bytes(&problem, DType::F32, pass).unwrap() as usize;
                    let budget = |b: usize| RingOptions::default().with_budget(MemoryBudget::bytes(b));
                    let free = run::<f32>(&problem, &vec![RingOptions::default(); world], backward, 9);
                    // Every rank one byte short, then only rank 1 short: every rank refuses alike.
                    let mut one_short = vec![RingOptions::default(); world];
                    one_short[1] = budget(need - 1);
                    for opts in [vec![budget(need - 1); world], one_short] {
                        for (rank, (r, got)) in run::<f32>(&problem, &opts, backward, 9).into_iter().enumerate() {
                            assert!(
                                matches!(r, Err(AttnError::OverBudget { needed, budget }) if needed == need && budget == need - 1),
                                "rank {rank}: {r:?}"
                            );
                            // Plan, handshake and refusal only: nothing near the workspace.
                            assert!(got <= 64 * 1024 && got < need / 4, "rank {rank} refused after {got} bytes (need {need})");
                            (refusals, most) = (refusals + 1, most.max(got));
                        }
                    }
                    // At exactly the workspace the call runs and matches the unlimited run bit for bit.
                    for (rank, ((r, _), (f, _))) in
                        run::<f32>(&problem, &vec![budget(need); world], backward, 9).into_iter().zip(free).enumerate()
                    {
                        let (r, f) = (r.expect("within budget"), f.expect("unlimited"));
                        assert!(r.len() == f.len() && r.iter().zip(&f).all(|(a, b)| a.to_bits() == b.to_bits()), "rank {rank}");
                    }
                }
            }
        }
        (refusals, most)
    })
    .expect("refusals hung");
    eprintln!("{refusals} rank-calls refused with OverBudget, each after at most {most} bytes");
}

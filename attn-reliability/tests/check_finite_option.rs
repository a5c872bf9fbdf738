//! The opt-in finite-input check: `CpuBackend::with_check_finite(FiniteCheck::Inputs)` and
//! `RingOptions::with_check_finite(FiniteCheck::Inputs)` refuse a call whose q, k, v (or grad_out in a
//! backward) hold a NaN or infinity with `NonFinite` naming the tensor and the first
//! flat index, before writing anything; the ring refuses on every rank alike (global
//! index). Off by default: the same inputs then compute as before.

use attn_core::FiniteCheck;
use attn_core::error::TensorName;
use attn_core::{
    Attention, AttnError, AttnInputs, DilatedConfig, Grads, Mixing, Saved, Shape4, TensorView, TensorViewMut,
};
use attn_kernels::CpuBackend;
use attn_ring::{Layout, RingOptions, Strategy, ThreadComm, backward_on_with, forward_on_with, problem_for};
use attn_testkit::rng::random_vec;

fn config() -> DilatedConfig {
    DilatedConfig::builder().segments(&[8, 32]).dilations(&[1, 2]).mixing(Mixing::LongNet).causal().build().unwrap()
}

const SHAPE: [usize; 4] = [2, 32, 2, 4];

fn shape() -> Shape4 {
    Shape4::new(SHAPE[0], SHAPE[1], SHAPE[2], SHAPE[3]).unwrap()
}

fn v(t: &[f32]) -> TensorView<'_, f32> {
    TensorView::contiguous(TensorName::Other("in"), t, shape()).unwrap()
}

/// q, k, v, grad_out with `bad` written at flat index `at` of tensor `which` (if any).
fn inputs(which: Option<usize>, at: usize, bad: f32) -> [Vec<f32>; 4] {
    let mut x = [0, 1, 2, 3].map(|i| random_vec(70 + i, shape().numel()));
    if let Some(t) = which {
        x[t][at] = bad;
    }
    x
}

const NAMES: [TensorName; 4] = [TensorName::Query, TensorName::Key, TensorName::Value, TensorName::GradOutput];

/// Positions to poison: the first and last elements and a few in between.
fn spots() -> Vec<usize> {
    let n = shape().numel();
    vec![0, 5, n / 3 + 1, n / 2, n - 1]
}

#[test]
fn the_cpu_backend_names_the_tensor_and_first_index_only_when_asked() {
    let (cfg, s) = (config(), shape());
    let checked = CpuBackend::new(2).unwrap().with_check_finite(FiniteCheck::Inputs);
    let plain = CpuBackend::new(2).unwrap();
    assert!(checked.checks_finite() && !plain.checks_finite());
    let mut cases = 0;
    for which in 0..4 {
        for at in spots() {
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let x = inputs(Some(which), at, bad);
                // A second bad value later on: the first one is reported.
                let mut x2 = x.clone();
                x2[which][shape().numel() - 1] = f32::NAN;
                let mut out = vec![7.0f32; s.numel()];
                let mut lse = vec![7.0f32; s.lse_len()];
                let (clean, clean_lse) = plain.forward_vec(&cfg, s, &x[0], &x[1], &x[2]).unwrap();
                let ov = TensorViewMut::contiguous(TensorName::Output, &mut out, s).unwrap();
                let fwd = checked.forward(&AttnInputs::new(&cfg, v(&x2[0]), v(&x2[1]), v(&x2[2])), ov, &mut lse);
                if which < 3 {
                    assert!(
                        matches!(fwd, Err(AttnError::NonFinite { tensor, index }) if tensor == NAMES[which] && index == at),
                        "{bad} in {} at {at}: {fwd:?}",
                        NAMES[which]
                    );
                    assert!(out.iter().chain(&lse).all(|&x| x == 7.0), "forward wrote before refusing");
                } else {
                    fwd.unwrap();
                }
                let [mut dq, mut dk, mut dv] = [0; 3].map(|_| vec![7.0f32; s.numel()]);
                let m = |x| TensorViewMut::contiguous(TensorName::Other("grad"), x, s).unwrap();
                let (o, go) = (v(&clean), v(&x2[3]));
                let grads = Grads { dq: m(&mut dq), dk: m(&mut dk), dv: m(&mut dv) };
                let inputs = AttnInputs::new(&cfg, v(&x2[0]), v(&x2[1]), v(&x2[2]));
                let bwd = checked.backward(&inputs, Saved { out: o, lse: &clean_lse }, go, grads);
                assert!(
                    matches!(bwd, Err(AttnError::NonFinite { tensor, index }) if tensor == NAMES[which] && index == at),
                    "backward: {bad} in {} at {at}: {bwd:?}",
                    NAMES[which]
                );
                assert!(dq.iter().chain(&dk).chain(&dv).all(|&x| x == 7.0), "backward wrote before refusing");
                // Unchecked, the same call computes (the poison stays in the rows that read it).
                assert!(plain.backward_vec(&cfg, s, [&x[0], &x[1], &x[2]], &clean, &clean_lse, &x[3]).is_ok());
                cases += 1;
            }
        }
    }
    // Finite inputs: the checked backend gives the same bits.
    let x = inputs(None, 0, 0.0);
    let (a, la) = checked.forward_vec(&cfg, shape(), &x[0], &x[1], &x[2]).unwrap();
    let (b, lb) = plain.forward_vec(&cfg, shape(), &x[0], &x[1], &x[2]).unwrap();
    assert!(a.iter().zip(&b).chain(la.iter().zip(&lb)).all(|(p, q)| p.to_bits() == q.to_bits()));
    eprintln!("cpu check_finite: {cases} poisoned cases, each refused with the first tensor and index");
}

#[test]
fn every_ring_rank_names_the_tensor_and_global_index() {
    let (cfg, s) = (config(), shape());
    let mut cases = 0;
    for (world, layout, strategy) in [(4, Layout::Zigzag, Strategy::Ring), (2, Layout::Contiguous, Strategy::AllGather)]
    {
        let problem = problem_for(&cfg, s, layout, strategy, world);
        let on = RingOptions::default().with_check_finite(FiniteCheck::Inputs);
        for (which, name) in NAMES.into_iter().enumerate() {
            for at in spots() {
                let x = inputs(Some(which), at, f32::NAN);
                let qkv = [v(&x[0]), v(&x[1]), v(&x[2])];
                let comms = || ThreadComm::world(world).unwrap();
                let fwd = forward_on_with(comms(), &problem, &on, qkv);
                let bwd = backward_on_with(comms(), &problem, &on, qkv, v(&x[3]));
                let bwd: Vec<_> = bwd.into_iter().map(|r| r.map(|_| ())).collect();
                let fwd: Vec<_> = fwd.into_iter().map(|r| r.map(|_| ())).collect();
                for (op, res, refused) in [("forward", fwd, which < 3), ("backward", bwd, true)] {
                    for (rank, r) in res.iter().enumerate() {
                        if refused {
                            assert!(
                                matches!(r, Err(AttnError::NonFinite { tensor, index }) if *tensor == name && *index == at),
                                "{op} world {world}: NaN in {name} at {at}: rank {rank} got {r:?}"
                            );
                        } else {
                            assert!(r.is_ok(), "{op}: grad_out is not a forward input: rank {rank} got {r:?}");
                        }
                    }
                }
                // Without the option the same call runs on every rank.
                let plain = RingOptions::default();
                assert!(forward_on_with(comms(), &problem, &plain, qkv).iter().all(|r| r.is_ok()));
                cases += 1;
            }
        }
    }
    eprintln!("ring check_finite: {cases} poisoned cases, every rank refused with the tensor and global index");
}

//! The nn modules on in-process ring ranks: a two-layer encoder stack where each rank runs
//! its own rows through its `RingBackend` (`forward_on` with `Compute::On`), with dropout
//! (training) and without. Every rank's output rows and input gradients, put together,
//! and the parameter gradients summed over the ranks equal the single-device stack and
//! `attn-multihead`'s; training dropout draws its masks at the rows' global positions.
//! Ranks passing rows other than their own get a typed error.

use std::sync::Arc;

use crate::common::encoder::{EncoderCase, Named, worst};
use crate::common::grad_device;
use crate::common::ring::{put_rows, rows_of};
use crate::dropout::dropout_config;
use attn_burn::nn::Mode;
use attn_burn::{AttnOptions, Compute, HostAttention};
use attn_core::{AttnError, DType as AttnDType};
use attn_ring::{Layout as RingLayout, RingBackend, Strategy, ThreadComm};
use attn_testkit::{Tolerance, rel_l2_error};
use burn_tensor::{DType, Tensor, TensorData};

/// `[batch, seq]`: 48 rows split into 2 or 3 ranks under both layouts.
const DIMS: [usize; 2] = [2, 48];

/// The stack on `world` ranks under `layout`: outputs and input gradients put back in
/// global row order, parameter gradients summed over the ranks.
fn ring_run(case: &EncoderCase, mode: Mode, world: usize, layout: RingLayout) -> Named {
    let [b, n, e] = case.dims;
    let comms = ThreadComm::world(world).expect("thread communicators");
    let ranks: Vec<(Vec<usize>, Named)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let backend = RingBackend::new(comm, n, layout, Strategy::Auto).expect("ring backend");
                    let pos = backend.positions();
                    let (x, go) = (rows_of(&case.x, [b, n, e], &pos), rows_of(&case.grad_out, [b, n, e], &pos));
                    let backend: Arc<dyn HostAttention> = Arc::new(backend);
                    (pos, case.burn_run(mode, [&x, &go], &Compute::On(backend)))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    // Rows go back to their global positions; parameter gradients add up.
    let global_len = |name: &str, len: usize| if matches!(name, "out" | "dx") { b * n * e } else { len };
    let mut global: Named =
        ranks[0].1.iter().map(|(name, g)| (name.clone(), vec![0.0; global_len(name, g.len())])).collect();
    for (pos, named) in &ranks {
        for ((name, total), (_, local)) in global.iter_mut().zip(named) {
            match name.as_str() {
                "out" | "dx" => put_rows(total, local, [b, n, e], pos),
                _ => total.iter_mut().zip(local).for_each(|(t, l)| *t += l),
            }
        }
    }
    global
}

#[test]
fn encoder_on_ring_ranks_equals_one_device_with_and_without_dropout() {
    let bound = Tolerance::for_dtype(AttnDType::F32).rel_l2;
    let config = dropout_config();
    let [b, n] = DIMS;
    let case = EncoderCase::new(&config, b, n);
    let mut runs = 0;
    for mode in [Mode::Eval, Mode::Train { seed: 7 }] {
        let single = case.burn_run(mode, [&case.x, &case.grad_out], &Compute::Kernels);
        let native = case.native_run(mode);
        let (err, name) = worst(&single, &native);
        assert!(err <= bound, "{mode:?}: one device against attn-multihead at {name}: {err:.2e}");
        for world in [2, 3] {
            for layout in [RingLayout::Contiguous, RingLayout::Zigzag] {
                let ring = ring_run(&case, mode, world, layout);
                for (against, want) in [("the single-device stack", &single), ("attn-multihead", &native)] {
                    let (err, name) = worst(&ring, want);
                    let label = format!("{mode:?} p={world} {}", layout.as_str());
                    assert!(err <= bound, "{label}: ranks against {against} at {name}: relative error {err:.2e}");
                }
                runs += 1;
            }
        }
    }
    assert_eq!(runs, 8);
}

/// The comparison above can fail: training on the ranks drops (its output is far from
/// evaluation's), so dropout masks drawn at other positions would not pass unnoticed.
#[test]
fn training_on_ring_ranks_drops() {
    let config = dropout_config();
    let [b, n] = DIMS;
    let case = EncoderCase::new(&config, b, n);
    let out = |mode| ring_run(&case, mode, 2, RingLayout::Zigzag).swap_remove(0).1;
    let (train, eval) = (out(Mode::Train { seed: 7 }), out(Mode::Eval));
    assert!(rel_l2_error(&train, &eval) > 0.1, "training and evaluation agree");
}

/// A rank passing rows other than its own (here every rank the whole sequence) gets a
/// typed error on every rank, in evaluation and in training, never a panic or rows of
/// another split.
#[test]
fn ranks_passing_other_rows_get_a_typed_error() {
    let config = dropout_config();
    let [b, n] = DIMS;
    let case = EncoderCase::new(&config, b, n);
    let stack = case.burn_stack();
    let opts = AttnOptions::new(config.attention.clone());
    for mode in [Mode::Eval, Mode::Train { seed: 7 }] {
        let comms = ThreadComm::world(2).expect("thread communicators");
        let errors: Vec<_> = std::thread::scope(|s| {
            let handles: Vec<_> = comms
                .into_iter()
                .map(|comm| {
                    let (stack, opts, case) = (&stack, &opts, &case);
                    s.spawn(move || {
                        let backend = RingBackend::new(comm, n, RingLayout::Zigzag, Strategy::Auto).expect("ring");
                        let backend: Arc<dyn HostAttention> = Arc::new(backend);
                        let data = TensorData::new(case.x.clone(), case.dims);
                        let x = Tensor::<3>::from_data(data, (&grad_device(), DType::F32));
                        stack.forward_on(x, opts, mode, &Compute::On(backend)).err()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
        });
        for (rank, err) in errors.into_iter().enumerate() {
            let err = err.unwrap_or_else(|| panic!("{mode:?}: rank {rank} accepted the whole sequence"));
            assert!(matches!(err, AttnError::RankDisagreement(_)), "{mode:?}: rank {rank}: {err:?}");
        }
    }
}

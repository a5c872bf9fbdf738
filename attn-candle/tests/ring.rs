//! Ring attention on candle tensors: each in-process rank runs the candle op through its
//! `RingBackend` on its own rows, forward and candle `backward()`, and the ranks' rows
//! put together equal the single-device op, output and gradients, on every layout and
//! strategy (`RingBackend::new`'s: the row plan's ring and auto, Ulysses and the hybrid).

use std::sync::Arc;

use attn_candle::{AttnOptions, attention_on, dilated_attention};
use attn_core::DilatedConfig;
use attn_ring::{Layout, RingBackend, Strategy, ThreadComm};
use attn_testkit::random_vec;
use attn_testkit::tolerance::rel_l2_error;
use candle_core::{Device, IndexOp, Tensor, Var};

const DIMS: [usize; 4] = [2, 40, 4, 8];

/// `(out, [dq, dk, dv])` of the loss `sum(out * g)` as global row-major f32.
type Result4 = (Vec<f32>, [Vec<f32>; 3]);

fn tensor(data: &[f32]) -> Tensor {
    Tensor::from_slice(data, DIMS.to_vec(), &Device::Cpu).expect("tensor")
}

fn single(opts: &AttnOptions, inputs: &[Vec<f32>; 4]) -> Result4 {
    let [q, k, v] = [0, 1, 2].map(|i| Var::from_tensor(&tensor(&inputs[i])).expect("var"));
    let out = dilated_attention(q.as_tensor(), k.as_tensor(), v.as_tensor(), opts).expect("forward");
    let grads = (&out * tensor(&inputs[3])).and_then(|l| l.sum_all()).and_then(|l| l.backward()).expect("backward");
    let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values");
    (flat(&out), [&q, &k, &v].map(|x| flat(grads.get(x.as_tensor()).expect("grad"))))
}

/// Rows `pos` of a global tensor, as a `[b, pos.len(), h, d]` tensor.
fn rows(t: &Tensor, pos: &[usize]) -> Tensor {
    let parts: Vec<Tensor> = pos.iter().map(|&p| t.i((.., p..p + 1)).expect("row")).collect();
    Tensor::cat(&parts, 1).expect("rows")
}

fn ring(opts: &AttnOptions, inputs: &[Vec<f32>; 4], world: usize, layout: Layout, strategy: Strategy) -> Result4 {
    let comms = ThreadComm::world(world).expect("world");
    let mut global = (vec![0f32; inputs[0].len()], [0, 1, 2].map(|_| vec![0f32; inputs[0].len()]));
    let per_rank: Vec<(Vec<usize>, Result4)> = std::thread::scope(|s| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                s.spawn(move || {
                    let backend = RingBackend::new(comm, DIMS[1], layout, strategy).expect("ring backend");
                    let pos = backend.positions();
                    let [q, k, v, g] = [0, 1, 2, 3].map(|i| rows(&tensor(&inputs[i]), &pos));
                    let [q, k, v] = [q, k, v].map(|x| Var::from_tensor(&x).expect("var"));
                    let out = attention_on(Arc::new(backend), q.as_tensor(), k.as_tensor(), v.as_tensor(), opts)
                        .expect("ring forward")
                        .out;
                    let grads = (&out * g).and_then(|l| l.sum_all()).and_then(|l| l.backward()).expect("backward");
                    let flat = |t: &Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>()).expect("values");
                    (pos, (flat(&out), [&q, &k, &v].map(|x| flat(grads.get(x.as_tensor()).expect("grad")))))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().expect("rank thread")).collect()
    });
    let [b, n, h, d] = DIMS;
    let row = h * d;
    for (pos, (out, grads)) in per_rank {
        let local = [&out, &grads[0], &grads[1], &grads[2]];
        for (t, src) in local.into_iter().enumerate() {
            let dst = if t == 0 { &mut global.0 } else { &mut global.1[t - 1] };
            for bi in 0..b {
                for (i, &p) in pos.iter().enumerate() {
                    let from = (bi * pos.len() + i) * row;
                    dst[(bi * n + p) * row..(bi * n + p + 1) * row].copy_from_slice(&src[from..from + row]);
                }
            }
        }
    }
    global
}

#[test]
fn ring_ranks_equal_the_single_device_op_forward_and_gradients() {
    let inputs: [Vec<f32>; 4] = [1, 2, 3, 4].map(|s| random_vec(s, DIMS.iter().product()));
    let configs = [
        DilatedConfig::builder().segments(&[8, 16, 40]).dilations(&[1, 2, 4]).causal().build(),
        DilatedConfig::builder().segments(&[10, 20]).dilations(&[1, 2]).mixing(attn_core::Mixing::LongNet).build(),
        DilatedConfig::builder().window(6, 2).build(),
    ];
    for cfg in configs {
        let opts = AttnOptions::new(cfg.expect("config"));
        let want = single(&opts, &inputs);
        for (world, layout, strategy) in [
            (2, Layout::Contiguous, Strategy::Auto),
            (3, Layout::Zigzag, Strategy::Ring),
            (4, Layout::Contiguous, Strategy::Ring),
            // The head strategies: the all-to-all over all ranks, and in groups of 2.
            (4, Layout::Zigzag, Strategy::Ulysses),
            (4, Layout::Contiguous, Strategy::Hybrid { ulysses: 2 }),
        ] {
            let got = ring(&opts, &inputs, world, layout, strategy);
            let label = format!("{:?} world {world} {layout:?} {strategy:?}", opts.config.mixing());
            assert!(rel_l2_error(&got.0, &want.0) <= 1e-5, "{label}: out");
            for (name, (g, w)) in ["dq", "dk", "dv"].iter().zip(got.1.iter().zip(&want.1)) {
                let e = rel_l2_error(g, w);
                assert!(e <= 1e-5, "{label}: {name} off by {e:.2e}");
            }
            // The bound bites: the largest dq entry 1% off fails it.
            let mut bad = got.1[0].clone();
            let i = (0..bad.len()).max_by(|&a, &b| bad[a].abs().total_cmp(&bad[b].abs())).expect("entries");
            bad[i] *= 1.01;
            assert!(rel_l2_error(&bad, &want.1[0]) > 1e-5, "{label}: a planted dq error passed");
        }
    }
}

//! `RingBackend` behind the shared interface with the features: each rank passes its
//! own rows of q, k, v (k and v with fewer heads) and of the key padding mask, and the
//! packed sequences of the whole batch; the reassembled rows equal the float64
//! reference's, with a gradient into the LSE too, under the row plan and the head
//! strategies (Ulysses, hybrid). A rank whose mask or LSE gradient does not fit its rows
//! makes every rank fail alike, and so does (when checked) a non-finite gradient into the
//! LSE on a row that attends something, under every strategy.

use attn_core::FiniteCheck;
use attn_core::error::TensorName;
use attn_core::{
    Attention, AttnError, AttnInputs, AttnShape, DType, DilatedConfig, Grads, KeyPadding, Masks, Mixing,
    PackedSequences, Saved, Shape4, TensorView, TensorViewMut,
};
use attn_ring::plan::heads_split::HeadSplit;
use attn_ring::{Communicator, Layout, RingBackend, RingOptions, Strategy, ThreadComm, local_rows};
use attn_testkit::golden::Problem;
use attn_testkit::judge::{Expected, judge_backward, judge_forward, verdict};
use attn_testkit::random_vec;

const WORLD: usize = 3;

/// The (world, strategy) runs of the gradient-into-the-LSE checks: the row plan, Ulysses
/// and the hybrid.
const LSE_RUNS: [(usize, Strategy); 3] =
    [(WORLD, Strategy::Auto), (4, Strategy::Ulysses), (4, Strategy::Hybrid { ulysses: 2 })];

/// One rank's rows: out, lse, dq, dk, dv.
type RankRows = (Vec<f32>, Vec<f32>, [Vec<f32>; 3]);

/// The global inputs of a call: q, k, v, grad_out, the gradient into the LSE, the key
/// padding flags and the packed sequences.
#[derive(Clone, Copy)]
struct Call<'a> {
    global: [&'a [f32]; 4],
    grad_lse: Option<&'a [f32]>,
    padding: Option<&'a [bool]>,
    cu: Option<&'a [usize]>,
    options: RingOptions,
    /// Ranks and strategy of the call.
    world: usize,
    strategy: Strategy,
}

/// Every rank's forward and backward through `RingBackend`, with `mask_rows(rank)` as
/// the rank's key padding rows and `lse_rows(rank)` as its rows of the LSE's gradient.
fn run(
    cfg: &DilatedConfig,
    shape: AttnShape,
    call: Call<'_>,
    mask_rows: impl Fn(usize, Vec<bool>) -> Vec<bool> + Sync,
    lse_rows: impl Fn(usize, Vec<f32>) -> Vec<f32> + Sync,
) -> Vec<attn_core::Result<RankRows>> {
    let Call { global, grad_lse, padding, cu, options, world, strategy } = call;
    let (seq, layout) = (shape.q.seq, Layout::Zigzag);
    let comms = ThreadComm::world(world).unwrap();
    std::thread::scope(|scope| {
        let handles: Vec<_> = comms
            .into_iter()
            .map(|comm| {
                let (mask_rows, lse_rows) = (&mask_rows, &lse_rows);
                scope.spawn(move || -> attn_core::Result<RankRows> {
                    let rank = comm.rank();
                    let be = RingBackend::new(comm, seq, layout, strategy)?.with_options(options);
                    let pos = be.positions();
                    let (ls, lkv) = (shape.q.with_seq(pos.len())?, shape.kv.with_seq(pos.len())?);
                    let gv = |i: usize, s: Shape4| TensorView::contiguous(TensorName::Other("g"), global[i], s);
                    let [q, k, v, go] = [(0, shape.q), (1, shape.kv), (2, shape.kv), (3, shape.q)]
                        .map(|(i, s)| gv(i, s).and_then(|x| local_rows(&x, &pos)));
                    let (q, k, v, go) = (q?, k?, v?, go?);
                    let flags: Option<Vec<bool>> = padding.map(|p| {
                        let rows = (0..shape.q.batch).flat_map(|b| pos.iter().map(move |&x| p[b * seq + x])).collect();
                        mask_rows(rank, rows)
                    });
                    let key_padding = flags
                        .as_deref()
                        .map(|f| KeyPadding::new(f, shape.q.batch, f.len() / shape.q.batch))
                        .transpose()?;
                    let packing = cu.map(PackedSequences::new).transpose()?;
                    let local = AttnShape { q: ls, kv: lkv };
                    let inputs = AttnInputs::contiguous(cfg, local, [&q, &k, &v])?.with_masks(Masks {
                        key_padding,
                        packing,
                        ..Masks::NONE
                    });
                    let (mut out, mut lse) = (vec![0.0f32; ls.numel()], vec![0.0f32; ls.lse_len()]);
                    be.forward(&inputs, TensorViewMut::contiguous(TensorName::Output, &mut out, ls)?, &mut lse)?;
                    let mut g = [vec![0.0f32; ls.numel()], vec![0.0f32; lkv.numel()], vec![0.0f32; lkv.numel()]];
                    let [dq, dk, dv] = &mut g;
                    let saved = Saved { out: TensorView::contiguous(TensorName::Output, &out, ls)?, lse: &lse };
                    let gov = TensorView::contiguous(TensorName::GradOutput, &go, ls)?;
                    let h = shape.q.heads;
                    let gl = grad_lse.map(|g| {
                        let rows = (0..shape.q.batch)
                            .flat_map(|b| pos.iter().flat_map(move |&x| g[(b * seq + x) * h..][..h].iter().copied()))
                            .collect();
                        lse_rows(rank, rows)
                    });
                    be.backward_with_lse_grad(
                        &inputs,
                        saved,
                        gov,
                        gl.as_deref(),
                        Grads::contiguous(local, [dq, dk, dv])?,
                    )?;
                    Ok((out, lse, g))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// Scatter rank rows (`[batch, rows, heads, inner]`) back to global positions.
fn gather(parts: &[&[f32]], shape: Shape4, inner: usize, seq: usize) -> Vec<f32> {
    let world = parts.len();
    let mut out = vec![0.0; shape.batch * seq * shape.heads * inner];
    let row = shape.heads * inner;
    for (rank, part) in parts.iter().enumerate() {
        let pos = Layout::Zigzag.positions(seq, world, rank);
        for b in 0..shape.batch {
            for (i, &p) in pos.iter().enumerate() {
                out[(b * seq + p) * row..(b * seq + p + 1) * row]
                    .copy_from_slice(&part[(b * pos.len() + i) * row..(b * pos.len() + i + 1) * row]);
            }
        }
    }
    out
}

#[test]
fn the_ring_backend_computes_every_feature_from_each_ranks_rows() {
    let seq = 50;
    let configs = [
        DilatedConfig::builder()
            .segments(&[8, 32])
            .dilations(&[1, 2])
            .mixing(Mixing::LongNet)
            .causal()
            .build()
            .unwrap(),
        DilatedConfig::builder().window(5, 2).build().unwrap(),
    ];
    let mut unattended = 0;
    for cfg in &configs {
        for packed in [false, true] {
            let batch = if packed { 1 } else { 2 };
            let q = Shape4::new(batch, seq, 4, 8).unwrap();
            let shape = AttnShape { q, kv: Shape4 { heads: 2, ..q } };
            let (nq, nk) = (q.numel(), shape.kv.numel());
            let inputs = [random_vec(1, nq), random_vec(2, nk), random_vec(3, nk), random_vec(4, nq)];
            let padding: Vec<bool> = (0..batch * seq).map(|i| i % 7 == 4 || i % seq > seq - 4).collect();
            let cu = [0, 13, 14, 50];
            let cu = packed.then_some(&cu[..]);
            let global = [&inputs[0][..], &inputs[1], &inputs[2], &inputs[3]];
            let masks = Masks {
                key_padding: Some(KeyPadding::new(&padding, batch, seq).unwrap()),
                packing: cu.map(|c| PackedSequences::new(c).unwrap()),
                ..Masks::NONE
            };
            let problem = Problem::new(cfg, shape).with_masks(masks);
            let wide = |x: &[f32]| x.iter().map(|&v| f64::from(v)).collect::<Vec<f64>>();
            let [qw, kw, vw, gw] = [&inputs[0], &inputs[1], &inputs[2], &inputs[3]].map(|x| wide(x));
            let plain = Expected::for_problem(&problem, [&qw, &kw, &vw], Some(&gw)).unwrap();
            // NaN where a row attends nothing (its LSE is -inf): such a row takes no gradient
            // from its LSE, whatever the value.
            let mut grad_lse = random_vec(5, q.lse_len());
            unattended += plain.fwd.lse.iter().filter(|l| !l.is_finite()).count();
            grad_lse.iter_mut().zip(&plain.fwd.lse).filter(|(_, l)| !l.is_finite()).for_each(|(g, _)| *g = f32::NAN);
            let with_lse = Expected::for_problem_lse(&problem, [&qw, &kw, &vw], &gw, &wide(&grad_lse)).unwrap();
            let runs = [(None, &plain)].into_iter().map(|r| (r, (WORLD, Strategy::Auto)));
            let with_lse = LSE_RUNS.into_iter().map(|run| ((Some(&grad_lse[..]), &with_lse), run));
            for ((gl, want), (world, strategy)) in runs.chain(with_lse) {
                let options = RingOptions::default().with_check_finite(FiniteCheck::Inputs);
                let call = Call { global, grad_lse: gl, padding: Some(&padding), cu, options, world, strategy };
                let ranks: Vec<RankRows> =
                    run(cfg, shape, call, |_, rows| rows, |_, rows| rows).into_iter().map(Result::unwrap).collect();
                let out = gather(&ranks.iter().map(|r| &r.0[..]).collect::<Vec<_>>(), q, 8, seq);
                let lse = gather(&ranks.iter().map(|r| &r.1[..]).collect::<Vec<_>>(), q, 1, seq);
                let grads: Vec<Vec<f32>> = (0..3)
                    .map(|t| {
                        let s = if t == 0 { q } else { shape.kv };
                        gather(&ranks.iter().map(|r| &r.2[t][..]).collect::<Vec<_>>(), s, 8, seq)
                    })
                    .collect();
                let mut rows = judge_forward(want, &out, &lse, DType::F32);
                rows.extend(judge_backward(want, [&grads[0], &grads[1], &grads[2]], DType::F32));
                let v = verdict(&rows);
                assert!(
                    v.is_ok(),
                    "{cfg:?} packed={packed} grad_lse={} {strategy:?}: {}",
                    gl.is_some(),
                    v.unwrap_err()
                );
            }
        }
    }
    assert!(unattended > 0, "no row that attends nothing: the NaN in grad_lse went untested");
}

#[test]
fn a_rank_with_a_misfit_mask_fails_every_rank() {
    let cfg = DilatedConfig::new(&[16], &[1]).unwrap();
    let q = Shape4::new(1, 30, 2, 4).unwrap();
    let shape = AttnShape::self_attn(q);
    let x = random_vec(1, q.numel());
    let padding = vec![false; 30];
    let call = Call {
        global: [&x, &x, &x, &x],
        grad_lse: None,
        padding: Some(&padding),
        cu: None,
        options: RingOptions::default(),
        world: WORLD,
        strategy: Strategy::Auto,
    };
    // Rank 1 passes one flag too few.
    let short = |rank: usize, mut rows: Vec<bool>| {
        if rank == 1 {
            rows.pop();
        }
        rows
    };
    for r in run(&cfg, shape, call, short, |_, rows| rows) {
        assert!(matches!(r, Err(AttnError::RankDisagreement(_))), "{r:?}");
    }
}

#[test]
fn a_rank_with_a_misfit_lse_gradient_fails_every_rank() {
    let cfg = DilatedConfig::new(&[16], &[1]).unwrap();
    let q = Shape4::new(1, 30, 2, 4).unwrap();
    let shape = AttnShape::self_attn(q);
    let x = random_vec(1, q.numel());
    let grad_lse = random_vec(2, q.lse_len());
    let call = Call {
        global: [&x, &x, &x, &x],
        grad_lse: Some(&grad_lse),
        padding: None,
        cu: None,
        options: RingOptions::default(),
        world: WORLD,
        strategy: Strategy::Auto,
    };
    // Rank 2 passes one value too many.
    let long = |rank: usize, mut rows: Vec<f32>| {
        if rank == 2 {
            rows.push(0.0);
        }
        rows
    };
    for r in run(&cfg, shape, call, |_, rows| rows, long) {
        match r {
            Err(AttnError::RankDisagreement(m)) => assert!(m.contains("grad_lse"), "{m}"),
            other => panic!("{other:?}"),
        }
    }
}

/// Checked, a non-finite gradient into the LSE on a row that attends something is
/// `NonFinite` (its global index) on the rank that reads it (the row's owner under the row
/// plan; under a head strategy the rank of the head's slot in the owner's group) and a
/// `Comm` error naming that rank everywhere else; unchecked, the call runs.
#[test]
fn a_non_finite_lse_gradient_on_a_row_that_attends_fails_every_rank_when_checked() {
    let cfg = DilatedConfig::new(&[16], &[1]).unwrap();
    let q = Shape4::new(1, 30, 2, 4).unwrap();
    let shape = AttnShape::self_attn(q);
    let x = random_vec(1, q.numel());
    let mut grad_lse = random_vec(2, q.lse_len());
    // Position 7, head 1.
    grad_lse[7 * 2 + 1] = f32::INFINITY;
    for (world, strategy) in [(WORLD, Strategy::Auto), (2, Strategy::Ulysses), (4, Strategy::Hybrid { ulysses: 2 })] {
        let owner = (0..world).find(|&r| Layout::Zigzag.positions(30, world, r).contains(&7)).unwrap();
        let reader = match strategy.ulysses_degree(world) {
            None => owner,
            Some(u) => {
                let split = HeadSplit::new(2, 2, u, world).unwrap();
                let slot = (0..u).find(|&j| split.slot_heads(j).contains(&1)).unwrap();
                split.rank_of(split.group_of(owner), slot)
            }
        };
        let options = RingOptions::default().with_check_finite(FiniteCheck::Inputs);
        let global = [&x[..], &x, &x, &x];
        let call = Call { global, grad_lse: Some(&grad_lse), padding: None, cu: None, options, world, strategy };
        for (rank, r) in run(&cfg, shape, call, |_, rows| rows, |_, rows| rows).into_iter().enumerate() {
            match r {
                Err(AttnError::NonFinite { tensor: TensorName::GradLse, index }) if rank == reader => {
                    assert_eq!(index, 7 * 2 + 1, "{strategy:?}")
                }
                Err(AttnError::Comm { message, .. }) if rank != reader => {
                    let named = message.contains(&format!("rank {reader}")) && message.contains("grad_lse");
                    assert!(named, "{strategy:?}: {message}")
                }
                other => panic!("{strategy:?} rank {rank} (reader {reader}): {other:?}"),
            }
        }
        // Unchecked, the value reaches the gradients as it would in any autograd.
        let call = Call { options: RingOptions::default(), ..call };
        assert!(run(&cfg, shape, call, |_, rows| rows, |_, rows| rows).into_iter().all(|r| r.is_ok()), "{strategy:?}");
    }
}

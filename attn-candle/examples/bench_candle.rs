//! The candle op against candle's own unfused dilated attention, as a candle user
//! would write it: per pattern, gather the selected rows (`index_select`), scores by
//! matmul, softmax, matmul with the values, scatter back (`index_add`), the head
//! groups side by side. Batch 1, 8 heads, head_dim 64, segments 2048,4096,8192,
//! dilations 1,2,4, f32, HeadGroups, non-causal. Prints a markdown table: median time
//! of several runs and peak heap above the inputs (counting global allocator).
//!
//! `cargo run --release -p attn-candle --example bench_candle`

use std::time::Instant;

use attn_candle::{AttnOptions, dilated_attention};
use attn_core::DilatedConfig;
use attn_reliability::counting_alloc::{self, CountingAlloc};
use attn_testkit::tolerance::rel_l2_error;
use candle_core::{DType, Device, Result, Tensor, Var};

#[global_allocator]
static ALLOC: CountingAlloc = CountingAlloc;

const HEADS: usize = 8;
const HEAD_DIM: usize = 64;
const SEGMENTS: [usize; 3] = [2048, 4096, 8192];
const DILATIONS: [usize; 3] = [1, 2, 4];

/// What one row of the table times.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Pass {
    Forward,
    ForwardBackward,
}

/// The heads of group `i` of `groups` (the first `HEADS % groups` groups hold one more).
fn group_heads(i: usize, groups: usize) -> (usize, usize) {
    let (base, extra) = (HEADS / groups, HEADS % groups);
    let start = i * base + i.min(extra);
    (start, base + usize::from(i < extra))
}

/// Unfused HeadGroups dilated attention of q, k, v `[1, n, HEADS, HEAD_DIM]`.
fn unfused(q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
    let (b, n, _, d) = q.dims4()?;
    let groups = SEGMENTS.len();
    let scale = 1.0 / (d as f64).sqrt();
    let mut outs = Vec::with_capacity(groups);
    for (i, (&w, &r)) in SEGMENTS.iter().zip(&DILATIONS).enumerate() {
        let (h0, hn) = group_heads(i, groups);
        let offset = i % r;
        let rows: Vec<u32> =
            (0..n).filter(|p| p % w >= offset && (p % w - offset) % r == 0).map(|p| p as u32).collect();
        let (segs, m) = (n / w, rows.len() / (n / w));
        let index = Tensor::from_vec(rows, n / r, q.device())?;
        // [b, segs * m, hn, d] -> [b * hn * segs, m, d] (candle's matmul batches one dim)
        let pick = |t: &Tensor| -> Result<Tensor> {
            t.narrow(2, h0, hn)?
                .contiguous()?
                .index_select(&index, 1)?
                .reshape((b, segs, m, hn, d))?
                .permute((0, 3, 1, 2, 4))?
                .contiguous()?
                .reshape((b * hn * segs, m, d))
        };
        let (qs, ks, vs) = (pick(q)?, pick(k)?, pick(v)?);
        let scores = (qs.matmul(&ks.transpose(1, 2)?.contiguous()?)? * scale)?;
        let weights = candle_nn::ops::softmax_last_dim(&scores)?;
        let o = weights.matmul(&vs)?.reshape((b, hn, segs, m, d))?.permute((0, 2, 3, 1, 4))?.reshape((
            b,
            segs * m,
            hn,
            d,
        ))?;
        let zeros = Tensor::zeros((b, n, hn, d), DType::F32, q.device())?;
        outs.push((zeros.index_add(&index, &o.contiguous()?, 1)? / groups as f64)?);
    }
    Tensor::cat(&outs, 2)
}

/// Median seconds and peak extra bytes of `runs` calls of `pass` over `attend`.
fn time(
    runs: usize,
    pass: Pass,
    qkv: &[Var; 3],
    attend: &dyn Fn(&Tensor, &Tensor, &Tensor) -> Result<Tensor>,
) -> Result<(f64, usize)> {
    let mut times = Vec::with_capacity(runs);
    let mut peak = 0;
    for _ in 0..runs {
        let (r, m) = counting_alloc::measure(|| -> Result<f64> {
            let start = Instant::now();
            let out = attend(qkv[0].as_tensor(), qkv[1].as_tensor(), qkv[2].as_tensor())?;
            if pass == Pass::ForwardBackward {
                let grads = out.sum_all()?.backward()?;
                drop(grads);
            }
            Ok(start.elapsed().as_secs_f64())
        });
        times.push(r?);
        peak = peak.max(m.peak_extra);
    }
    times.sort_by(f64::total_cmp);
    Ok((times[runs / 2], peak))
}

fn main() -> Result<()> {
    let cfg = DilatedConfig::new(&SEGMENTS, &DILATIONS).map_err(attn_candle::to_candle)?;
    let options = AttnOptions::new(cfg);
    let ours = |q: &Tensor, k: &Tensor, v: &Tensor| dilated_attention(q, k, v, &options);
    let plan = [(8192, Pass::Forward, 7), (8192, Pass::ForwardBackward, 5), (65536, Pass::Forward, 3)];
    println!(
        "| seq | pass | candle op (ms) | unfused candle (ms) | speedup | op peak (MiB) | unfused peak (MiB) | rel. L2 diff |"
    );
    println!("| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: |");
    for (n, pass, runs) in plan {
        let mk = |seed: u64| {
            let data = attn_testkit::rng::random_vec(seed, n * HEADS * HEAD_DIM);
            Var::from_vec(data, (1, n, HEADS, HEAD_DIM), &Device::Cpu)
        };
        let qkv = [mk(1)?, mk(2)?, mk(3)?];
        let diff = {
            let (a, b) = (ours(&qkv[0], &qkv[1], &qkv[2])?, unfused(&qkv[0], &qkv[1], &qkv[2])?);
            let flat = |t: Tensor| t.flatten_all().and_then(|t| t.to_vec1::<f32>());
            rel_l2_error(&flat(a)?, &flat(b)?)
        };
        let (t_op, m_op) = time(runs, pass, &qkv, &ours)?;
        let (t_un, m_un) = time(runs, pass, &qkv, &unfused)?;
        let mib = |b: usize| b as f64 / (1 << 20) as f64;
        println!(
            "| {n} | {} | {:.1} | {:.1} | {:.2}x | {:.0} | {:.0} | {diff:.1e} |",
            match pass {
                Pass::Forward => "forward",
                Pass::ForwardBackward => "forward+backward",
            },
            t_op * 1e3,
            t_un * 1e3,
            t_un / t_op,
            mib(m_op),
            mib(m_un),
        );
    }
    Ok(())
}

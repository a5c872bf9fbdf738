//! The candle op of `attn-candle` (feature `candle`) behind the f32 golden interface:
//! inputs rounded to the chosen dtype as candle tensors, the forward through the op and
//! the gradients through candle's `backward()`.

use attn_candle::{AttnOptions, InputLayout, KeyPaddingMask, dilated_attention_with_lse, run_buffers};
use attn_core::{AttnError, DType, Result};
use attn_testkit::golden::Problem;
use attn_testkit::{DilatedBackend, Forward32, Gradients32};
use candle_core::Tensor;

pub struct CandleDilated {
    pub dtype: DType,
}

fn candle_dtype(dtype: DType) -> candle_core::DType {
    match dtype {
        DType::BF16 => candle_core::DType::BF16,
        DType::F16 => candle_core::DType::F16,
        _ => candle_core::DType::F32,
    }
}

impl CandleDilated {
    /// Forward and `backward()` of `sum(out * grad_out)` on the problem.
    fn run(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<attn_candle::BufferRun> {
        let mut opts = AttnOptions::new(p.cfg.clone());
        if let Some(m) = p.masks.key_padding {
            opts = opts.with_key_padding(KeyPaddingMask::new(m.flags().to_vec(), m.batch(), m.seq())?);
        }
        if let Some(packing) = p.masks.packing {
            opts = opts.with_cu_seqlens(packing.cu_seqlens().to_vec())?;
        }
        let attend = |q: &Tensor, k: &Tensor, v: &Tensor| {
            let r = dilated_attention_with_lse(q, k, v, &opts)?;
            Ok((r.out, r.lse.flatten_all()?.to_vec1()?))
        };
        let dims = [p.shape.q.dims(), p.shape.kv.dims()];
        run_buffers(attend, qkv, dims, grad_out, (candle_dtype(self.dtype), InputLayout::Bshd))
            .map_err(|e| AttnError::backend("candle", e.to_string()))
    }
}

impl DilatedBackend for CandleDilated {
    fn name(&self) -> String {
        format!("candle {}", self.dtype.as_str())
    }
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn forward(&self, p: &Problem<'_>, qkv: [&[f32]; 3]) -> Result<Forward32> {
        let r = self.run(p, qkv, &vec![0.0; p.shape.q.numel()])?;
        Ok(Forward32 { out: r.out, lse: r.lse })
    }
    fn backward(&self, p: &Problem<'_>, qkv: [&[f32]; 3], grad_out: &[f32]) -> Result<Gradients32> {
        let [dq, dk, dv] = self.run(p, qkv, grad_out)?.grads;
        Ok(Gradients32 { dq, dk, dv })
    }
}

//! One forward or backward call: the dtype dispatch, the masks, the CPU backend for the
//! requested thread count, and the computation itself with the interpreter released.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use attn_core::{
    Attention, AttnError, AttnInputs, BlockDims, BlockMaskBuf, DType, DilatedConfig, Element, Grads, KeyPaddingMask,
    OwnedMasks, Result, Saved, TensorName,
};
use attn_kernels::CpuBackend;
use pyo3::Python;

use crate::raw::{Access, Checked, RawTensor, check_disjoint, torch_name};

/// The CPU backends built so far, one per thread count (a backend owns a thread pool,
/// which is too costly to build per call).
fn backend(threads: usize) -> Result<Arc<CpuBackend>> {
    static BACKENDS: OnceLock<Mutex<HashMap<usize, Arc<CpuBackend>>>> = OnceLock::new();
    let map = BACKENDS.get_or_init(|| Mutex::new(HashMap::new()));
    let mut map = map.lock().map_err(|_| AttnError::InvalidArgument("the backend cache is poisoned".into()))?;
    if let Some(b) = map.get(&threads) {
        return Ok(Arc::clone(b));
    }
    let b = Arc::new(CpuBackend::new(threads)?);
    map.insert(threads, Arc::clone(&b));
    Ok(b)
}

/// The masks of a call as the Python side passes them: a `[batch, key_seq]` bool or
/// uint8 key padding mask, the `cu_seqlens` of packed sequences, and a `[batch or 1,
/// heads or 1, q_blocks, k_blocks]` bool or uint8 block mask (1 = kept) over blocks of
/// `block_size` positions.
#[derive(Debug, Default)]
pub struct MaskArgs {
    pub key_padding: Option<RawTensor>,
    pub cu_seqlens: Option<Vec<i64>>,
    pub block_mask: Option<RawTensor>,
    pub block_size: Option<usize>,
}

/// The block mask's bytes (copied, as the key padding mask's) and block size; a mask
/// without a size, or a size without a mask, is a typed error.
pub(crate) fn read_block_mask(args: &MaskArgs, written: &[&Checked]) -> Result<Option<BlockMaskBuf>> {
    let raw = match (&args.block_mask, args.block_size) {
        (None, None) => return Ok(None),
        (Some(raw), Some(_)) => raw,
        (Some(_), None) => return Err(AttnError::InvalidBlockMask("block_mask needs block_size".into())),
        (None, Some(_)) => return Err(AttnError::InvalidBlockMask("block_size was given without a block_mask".into())),
    };
    let name = TensorName::Other("block_mask");
    if !matches!(raw.dtype(), "bool" | "uint8") {
        return Err(AttnError::DTypeMismatch { tensor: name, expected: "bool or uint8", got: raw.dtype().into() });
    }
    let c = raw.check(name, 4, 1, 1)?;
    let mut all: Vec<(&Checked, Access)> = written.iter().map(|w| (*w, Access::Write)).collect();
    all.push((&c, Access::Read));
    check_disjoint(&all)?;
    let d = c.dims();
    let dims = BlockDims { batch: d[0], heads: d[1], q_blocks: d[2], k_blocks: d[3] };
    let block_size = args.block_size.unwrap_or_default();
    BlockMaskBuf::new(c.bytes_4d(), dims, block_size).map(Some)
}

/// `cu_seqlens` as offsets (a negative entry is an error).
pub(crate) fn cu_seqlens(args: &MaskArgs) -> Result<Option<Vec<usize>>> {
    let Some(cu) = &args.cu_seqlens else { return Ok(None) };
    cu.iter()
        .map(|&x| usize::try_from(x))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map(Some)
        .map_err(|_| AttnError::InvalidCuSeqlens(format!("{cu:?} holds a negative entry")))
}

/// Read the mask bytes (copied: a mask is one byte per key, and none may alias a tensor
/// the call writes) and check `cu_seqlens`.
pub(crate) fn read_masks(args: &MaskArgs, written: &[&Checked]) -> Result<OwnedMasks> {
    let mut masks = OwnedMasks::none();
    if let Some(raw) = &args.key_padding {
        let name = TensorName::KeyPaddingMask;
        if !matches!(raw.dtype(), "bool" | "uint8") {
            return Err(AttnError::DTypeMismatch { tensor: name, expected: "bool", got: raw.dtype().into() });
        }
        let c = raw.check(name, 2, 1, 1)?;
        let mut all: Vec<(&Checked, Access)> = written.iter().map(|w| (*w, Access::Write)).collect();
        all.push((&c, Access::Read));
        check_disjoint(&all)?;
        masks = masks.with_key_padding(KeyPaddingMask::new(c.flags_2d(), c.dims()[0], c.dims()[1])?);
    }
    if let Some(block) = read_block_mask(args, written)? {
        masks = masks.with_block_mask(block);
    }
    match cu_seqlens(args)? {
        Some(cu) => masks.with_cu_seqlens(cu),
        None => Ok(masks),
    }
}

/// The tensors of a forward call: inputs, then the outputs it writes (`out` like q,
/// `lse` float32 `[batch, seq, heads]`, both contiguous or strided).
#[derive(Debug)]
pub struct ForwardArgs {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub out: RawTensor,
    pub lse: RawTensor,
}

/// The tensors of a backward call: the forward's inputs and outputs, `grad_out`, and the
/// gradients it writes.
#[derive(Debug)]
pub struct BackwardArgs {
    pub q: RawTensor,
    pub k: RawTensor,
    pub v: RawTensor,
    pub out: RawTensor,
    pub lse: RawTensor,
    pub grad_out: RawTensor,
    pub dq: RawTensor,
    pub dk: RawTensor,
    pub dv: RawTensor,
    /// The gradient into the LSE (float32, the LSE's sizes, contiguous), or none.
    pub grad_lse: Option<RawTensor>,
    /// The CUDA backward's f32 scratch from the caller's allocator (one contiguous
    /// float32 tensor: the dq, dk, dv accumulators, then delta), or none (the device's
    /// own pool); the CPU backward takes none.
    pub scratch: Option<RawTensor>,
}

/// `f::<T>(args)` for the element type `T` of q's dtype (`bfloat16`, `float16`, else
/// `float32`, which the typed call checks).
macro_rules! by_dtype {
    ($q:expr, $f:ident($($arg:expr),*)) => {
        match $crate::call::dtype_of($q)? {
            attn_core::DType::BF16 => $f::<half::bf16>($($arg),*),
            attn_core::DType::F16 => $f::<half::f16>($($arg),*),
            _ => $f::<f32>($($arg),*),
        }
    };
}
#[cfg_attr(not(feature = "cuda"), allow(unused_imports))]
pub(crate) use by_dtype;

/// The element type a call runs in, from q's dtype name.
pub(crate) fn dtype_of(q: &RawTensor) -> Result<DType> {
    match q.dtype() {
        "float32" => Ok(DType::F32),
        "bfloat16" => Ok(DType::BF16),
        "float16" => Ok(DType::F16),
        other => Err(AttnError::DTypeMismatch {
            tensor: TensorName::Query,
            expected: "float32, bfloat16 or float16",
            got: other.into(),
        }),
    }
}

/// q's `[batch, seq, heads]`, the LSE's sizes.
pub(crate) fn lse_dims(q: &Checked) -> [usize; 3] {
    let d = q.dims();
    [d[0], d[1], d[2]]
}

/// Check the tensors both passes take: q, k, v and out of `T`, and the float32 LSE.
fn check_common<T: Element>([q, k, v, out, lse]: [&RawTensor; 5]) -> Result<[Checked; 5]> {
    lse.expect_dtype(TensorName::Lse, torch_name(DType::F32))?;
    Ok([
        q.check4::<T>(TensorName::Query)?,
        k.check4::<T>(TensorName::Key)?,
        v.check4::<T>(TensorName::Value)?,
        out.check4::<T>(TensorName::Output)?,
        lse.check(TensorName::Lse, 3, 4, 4)?,
    ])
}

/// A forward call's tensors checked: `[q, k, v, out, lse]`, the written ones apart from
/// every other.
pub(crate) fn checked_forward<T: Element>(args: &ForwardArgs) -> Result<[Checked; 5]> {
    let c = check_common::<T>([&args.q, &args.k, &args.v, &args.out, &args.lse])?;
    let [q, k, v, out, lse] = &c;
    use Access::{Read, Write};
    check_disjoint(&[(q, Read), (k, Read), (v, Read), (out, Write), (lse, Write)])?;
    Ok(c)
}

/// A backward call's tensors checked: `[q, k, v, out, lse]`, `grad_out` and
/// `[dq, dk, dv]`, the written ones apart from every other.
pub(crate) fn checked_backward<T: Element>(args: &BackwardArgs) -> Result<CheckedBackward> {
    let c = check_common::<T>([&args.q, &args.k, &args.v, &args.out, &args.lse])?;
    let grad_out = args.grad_out.check4::<T>(TensorName::GradOutput)?;
    let grads = [
        args.dq.check4::<T>(TensorName::GradQuery)?,
        args.dk.check4::<T>(TensorName::GradKey)?,
        args.dv.check4::<T>(TensorName::GradValue)?,
    ];
    let grad_lse = match &args.grad_lse {
        Some(g) => {
            g.expect_dtype(TensorName::GradLse, torch_name(DType::F32))?;
            Some(g.check(TensorName::GradLse, 3, 4, 4)?)
        }
        None => None,
    };
    use Access::{Read, Write};
    let mut all: Vec<(&Checked, Access)> = c.iter().chain([&grad_out]).chain(&grad_lse).map(|t| (t, Read)).collect();
    all.extend(grads.iter().map(|t| (t, Write)));
    check_disjoint(&all)?;
    Ok(CheckedBackward { saved: c, grad_out, grad_lse, grads })
}

/// A backward call's tensors checked by [`checked_backward`].
pub(crate) struct CheckedBackward {
    /// `[q, k, v, out, lse]`.
    pub saved: [Checked; 5],
    pub grad_out: Checked,
    pub grad_lse: Option<Checked>,
    /// `[dq, dk, dv]`.
    pub grads: [Checked; 3],
}

/// Run the forward: writes `out` and `lse`.
pub fn forward(
    py: Python<'_>,
    cfg: &DilatedConfig,
    args: &ForwardArgs,
    masks: &MaskArgs,
    threads: usize,
) -> Result<()> {
    by_dtype!(&args.q, forward_typed(py, cfg, args, masks, threads))
}

fn forward_typed<T: Element>(
    py: Python<'_>,
    cfg: &DilatedConfig,
    args: &ForwardArgs,
    mask_args: &MaskArgs,
    threads: usize,
) -> Result<()> {
    let [q, k, v, out, lse] = checked_forward::<T>(args)?;
    let owned = read_masks(mask_args, &[&out, &lse])?;
    let inputs = AttnInputs::new(cfg, q.view::<T>()?, k.view::<T>()?, v.view::<T>()?).with_masks(owned.view());
    inputs.shape()?;
    let out_view = out.view_mut::<T>()?;
    if out_view.shape() != inputs.q.shape() {
        return Err(AttnError::ShapeMismatch {
            tensor: TensorName::Output,
            expected: inputs.q.shape().dims().to_vec(),
            got: out_view.shape().dims().to_vec(),
        });
    }
    let lse = lse.contiguous_f32_mut(&lse_dims(&q))?;
    let cpu = backend(threads)?;
    py.detach(|| cpu.forward(&inputs, out_view, lse))
}

/// Run the backward: writes `dq`, `dk` and `dv`.
pub fn backward(
    py: Python<'_>,
    cfg: &DilatedConfig,
    args: &BackwardArgs,
    masks: &MaskArgs,
    threads: usize,
) -> Result<()> {
    by_dtype!(&args.q, backward_typed(py, cfg, args, masks, threads))
}

fn backward_typed<T: Element>(
    py: Python<'_>,
    cfg: &DilatedConfig,
    args: &BackwardArgs,
    mask_args: &MaskArgs,
    threads: usize,
) -> Result<()> {
    if args.scratch.is_some() {
        return Err(AttnError::InvalidArgument("scratch is taken by the CUDA backward only".into()));
    }
    let CheckedBackward { saved: [q, k, v, out, lse], grad_out, grad_lse, grads: [dq, dk, dv] } =
        checked_backward::<T>(args)?;
    let owned = read_masks(mask_args, &[&dq, &dk, &dv])?;
    let inputs = AttnInputs::new(cfg, q.view::<T>()?, k.view::<T>()?, v.view::<T>()?).with_masks(owned.view());
    let shape = inputs.shape()?;
    let saved = Saved { out: out.view::<T>()?, lse: lse.contiguous_f32(&lse_dims(&q))? };
    let grad_lse = grad_lse.map(|g| g.contiguous_f32(&lse_dims(&q))).transpose()?;
    let grad_out = grad_out.view::<T>()?;
    let grads = Grads { dq: dq.view_mut::<T>()?, dk: dk.view_mut::<T>()?, dv: dv.view_mut::<T>()? };
    let checks = [
        (TensorName::Output, saved.out.shape(), shape.q),
        (TensorName::GradOutput, grad_out.shape(), shape.q),
        (TensorName::GradQuery, grads.dq.shape(), shape.q),
        (TensorName::GradKey, grads.dk.shape(), shape.kv),
        (TensorName::GradValue, grads.dv.shape(), shape.kv),
    ];
    for (tensor, got, want) in checks {
        if got != want {
            return Err(AttnError::ShapeMismatch { tensor, expected: want.dims().to_vec(), got: got.dims().to_vec() });
        }
    }
    let cpu = backend(threads)?;
    py.detach(|| cpu.backward_with_lse_grad(&inputs, saved, grad_out, grad_lse, grads))
}

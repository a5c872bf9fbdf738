//! Byte encoding of data messages: a small header (kind, owner, step) checked on
//! receipt, then rows as the input dtype (k/v) or f32 (dk/dv), little endian.

use attn_core::{AttnError, DType, Element, Result};
use half::{bf16, f16};

use crate::plan::MSG_HEADER_BYTES;

/// What a data message carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub(crate) enum MsgKind {
    RingKv = 1,
    RingGrad = 2,
    RingGradHome = 3,
    GatherKv = 4,
    GatherGrad = 5,
    ChunkKv = 6,
    ChunkKvGrad = 7,
    ChunkGradHome = 8,
    /// Ulysses: a rank's rows of a slot's heads (q, k, v; the backward adds grad_out).
    HeadsIn = 9,
    /// Ulysses: a group's k/v rows of a slot, to the same slot of the next group.
    HeadsAcross = 10,
    /// Ulysses: out and lse of a slot's heads, back to the rows' owner.
    HeadsOut = 11,
    /// Ulysses: f32 dk/dv of a group's rows, home at the end of the backward's ring.
    HeadsGradAcross = 12,
    /// Ulysses: f32 dq, dk, dv back to the rows' owner.
    HeadsGradOut = 13,
    /// Ulysses: a group's k/v rows with their f32 dk/dv so far, on the backward's ring.
    HeadsKvGradAcross = 14,
}

/// Start a message with its header.
pub(crate) fn begin(kind: MsgKind, owner: usize, step: usize, payload_hint: usize) -> Vec<u8> {
    // Spare room in front for the frame header, inserted in place when sent.
    let mut v = Vec::with_capacity(crate::comm::HEADER_BYTES + MSG_HEADER_BYTES as usize + payload_hint);
    v.push(kind as u8);
    v.extend_from_slice(&(owner as u32).to_le_bytes());
    v.extend_from_slice(&(step as u32).to_le_bytes());
    v
}

/// What a received message must be: its kind, owner and step (checked against its
/// header), for the receiving `rank` (named in errors).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Expected {
    pub kind: MsgKind,
    pub owner: usize,
    pub step: usize,
    pub rank: usize,
}

/// A reader over one received message whose header has been checked.
#[derive(Debug)]
pub(crate) struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
    rank: usize,
}

impl<'a> Reader<'a> {
    /// Check the header against what the plan says must arrive.
    pub fn open(bytes: &'a [u8], want: Expected) -> Result<Self> {
        let Expected { kind, owner, step, rank } = want;
        let h = MSG_HEADER_BYTES as usize;
        let want = begin(kind, owner, step, 0);
        if bytes.len() < h || bytes[..h] != want[..] {
            return Err(AttnError::Comm {
                rank,
                message: format!("unexpected message: wanted {kind:?} of owner {owner} at step {step}"),
            });
        }
        Ok(Reader { bytes, at: h, rank })
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.bytes.len()).ok_or_else(|| AttnError::Comm {
            rank: self.rank,
            message: format!("message too short: need {n} bytes at {} of {}", self.at, self.bytes.len()),
        })?;
        let s = &self.bytes[self.at..end];
        self.at = end;
        Ok(s)
    }

    /// Read `n` values written by [`put_elems`] for dtype `T` (exact).
    pub fn elems<T: Element>(&mut self, n: usize, out: &mut Vec<T>) -> Result<()> {
        let bytes = self.take(n * T::DTYPE.size())?;
        get_elems(bytes, out);
        Ok(())
    }

    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Result<&'a [u8]> {
        self.take(n)
    }

    /// Bytes read so far (the header included).
    pub fn position(&self) -> usize {
        self.at
    }

    /// Skip `n` bytes (error if the message is shorter).
    pub fn skip(&mut self, n: usize) -> Result<()> {
        self.take(n).map(|_| ())
    }

    /// Read `n` f32 values.
    pub fn f32s(&mut self, n: usize, out: &mut Vec<f32>) -> Result<()> {
        out.extend(f32s_exact(self.take(n * 4)?, n)?);
        Ok(())
    }

    /// Error unless every byte was read.
    pub fn finish(self) -> Result<()> {
        if self.at != self.bytes.len() {
            return Err(AttnError::Comm {
                rank: self.rank,
                message: format!("message has {} unexpected trailing bytes", self.bytes.len() - self.at),
            });
        }
        Ok(())
    }
}

/// Decode little-endian values of dtype `T` into `out`, exactly.
pub(crate) fn get_elems<T: Element>(bytes: &[u8], out: &mut Vec<T>) {
    out.reserve(bytes.len() / T::DTYPE.size());
    let half_bits = |c: &[u8]| u16::from_le_bytes([c[0], c[1]]);
    match T::DTYPE {
        DType::F32 => {
            out.extend(bytes.chunks_exact(4).map(|c| T::from_f32(f32::from_le_bytes([c[0], c[1], c[2], c[3]]))))
        }
        DType::F64 => {
            out.extend(bytes.chunks_exact(8).map(|c| T::from_f64(f64::from_le_bytes(c.try_into().unwrap_or([0; 8])))))
        }
        DType::F16 => out.extend(bytes.chunks_exact(2).map(|c| T::from_f32(f16::from_bits(half_bits(c)).to_f32()))),
        DType::BF16 => out.extend(bytes.chunks_exact(2).map(|c| T::from_f32(bf16::from_bits(half_bits(c)).to_f32()))),
    }
}

/// Exactly `n` values of dtype `T` from `bytes` (an error when the length differs).
pub(crate) fn elems_exact<T: Element>(bytes: &[u8], n: usize) -> Result<Vec<T>> {
    check_len(bytes, n, T::DTYPE.size())?;
    let mut out = Vec::new();
    get_elems(bytes, &mut out);
    Ok(out)
}

/// Exactly `n` f32 values from `bytes` (an error when the length differs).
pub(crate) fn f32s_exact(bytes: &[u8], n: usize) -> Result<Vec<f32>> {
    check_len(bytes, n, 4)?;
    Ok(bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect())
}

fn check_len(bytes: &[u8], n: usize, size: usize) -> Result<()> {
    if bytes.len() != n * size {
        return Err(AttnError::InvalidArgument(format!("{} bytes for {n} values of {size} bytes", bytes.len())));
    }
    Ok(())
}

/// Append values of dtype `T`, little endian, exactly.
pub(crate) fn put_elems<T: Element>(out: &mut Vec<u8>, xs: &[T]) {
    match T::DTYPE {
        DType::F32 => xs.iter().for_each(|x| out.extend_from_slice(&x.to_f32().to_le_bytes())),
        DType::F64 => xs.iter().for_each(|x| out.extend_from_slice(&x.to_f64().to_le_bytes())),
        DType::F16 => xs.iter().for_each(|x| out.extend_from_slice(&f16::from_f32(x.to_f32()).to_bits().to_le_bytes())),
        DType::BF16 => {
            xs.iter().for_each(|x| out.extend_from_slice(&bf16::from_f32(x.to_f32()).to_bits().to_le_bytes()))
        }
    }
}

/// Append f32 values.
pub(crate) fn put_f32s(out: &mut Vec<u8>, xs: &[f32]) {
    xs.iter().for_each(|x| out.extend_from_slice(&x.to_le_bytes()));
}

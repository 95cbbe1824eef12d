//! Bagua's centralized low-precision all-reduce (ByteGrad's, and QAdam's
//! after its warm-up), on one communicator of `p` ranks.
//!
//! The buffer is cut into `p` chunks (chunk `j` is elements
//! `[n·j/p, n·(j+1)/p)`: Bagua's equal chunks when `p` divides `n`, which
//! its bucket padding ensures; ringlet needs no padding). Each chunk is
//! compressed on its own (its min and max, then one byte per element, see
//! [`codec`]), so one outlier spoils the resolution of one chunk only.
//!
//! 1. *Scatter*: every rank compresses all `p` chunks and sends chunk `j` to
//!    rank `j` (one all-to-all of bytes): rank `j` receives every rank's
//!    version of chunk `j`, at a quarter of float32's bytes.
//! 2. *Reduce*: rank `j` decompresses the `p` versions, adds them in rank
//!    order in float32 (float64 for float64) and divides by `p` when
//!    averaging, as Bagua's `reduce_mean_inplace` does (its CUDA kernel adds
//!    in a tree; the rank order here is what a plain-torch reference does).
//! 3. *Gather*: rank `j` compresses its reduced chunk and every rank gathers
//!    all of them (one all-gather of bytes) and decompresses them, its own
//!    included, so every rank ends with the same bits.
//!
//! Each value is quantized twice (by its sender, then by the chunk's
//! owner); with *error feedback* ([`Feedback`], ringlet's addition) both
//! quantization errors are kept and added back before the next
//! compression: the sender's to its next gradient (the whole bucket), the
//! owner's to its next reduced chunk (DoubleSqueeze's worker and server
//! errors), so nothing a rank contributes is lost for good.

use super::arith;
use super::codec;
use super::codec4;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::group::Communicator;
use std::ops::Range;

/// Chunk `j` of `n` elements cut in `p`.
pub(crate) fn chunk(n: usize, p: usize, j: usize) -> Range<usize> {
    let at = |k: usize| ((n as u128 * k as u128) / p as u128) as usize;
    at(j)..at(j + 1)
}

/// How a compressed all-reduce quantizes: Bagua's MinMaxUInt8 (one
/// minimum and maximum per chunk, a byte per element), or MinMaxUInt4
/// (15 levels on blocks of 512 elements, two elements per byte;
/// [`codec4`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Codec {
    /// 8 bits per element, per chunk ([`codec`]).
    MinMaxUInt8,
    /// 4 bits per element, per block of 512 ([`codec4`]).
    MinMaxUInt4,
}

impl Codec {
    /// The codec named `name` (`"MinMaxUInt8"` or `"MinMaxUInt4"`).
    pub fn by_name(name: &str) -> Result<Codec> {
        match name {
            "MinMaxUInt8" => Ok(Codec::MinMaxUInt8),
            "MinMaxUInt4" => Ok(Codec::MinMaxUInt4),
            other => Err(Error::InvalidArgument(format!(
                "unknown compression {other:?}: ringlet implements \"MinMaxUInt8\" and \
                 \"MinMaxUInt4\" (or None for none)"
            ))),
        }
    }

    /// Its name, as [`Codec::by_name`] takes it.
    pub fn name(self) -> &'static str {
        match self {
            Codec::MinMaxUInt8 => "MinMaxUInt8",
            Codec::MinMaxUInt4 => "MinMaxUInt4",
        }
    }

    /// Bytes of a compressed chunk of `elements` elements.
    pub fn compressed_len(self, dtype: DType, elements: usize) -> usize {
        match self {
            Codec::MinMaxUInt8 => codec::compressed_len(dtype, elements),
            Codec::MinMaxUInt4 => codec4::compressed_len(dtype, elements),
        }
    }

    /// Compresses the chunk `src` into `dst`.
    pub fn compress(self, dtype: DType, src: &[u8], dst: &mut [u8]) -> Result<()> {
        match self {
            Codec::MinMaxUInt8 => codec::compress(dtype, src, dst),
            Codec::MinMaxUInt4 => codec4::compress(dtype, src, dst),
        }
    }

    /// Decompresses the chunk `src` into `dst`.
    pub fn decompress(self, dtype: DType, src: &[u8], dst: &mut [u8]) -> Result<()> {
        match self {
            Codec::MinMaxUInt8 => codec::decompress(dtype, src, dst),
            Codec::MinMaxUInt4 => codec4::decompress(dtype, src, dst),
        }
    }

    fn accumulate(self, dtype: DType, src: &[u8], acc: &mut [f32], first: bool) -> Result<()> {
        match self {
            Codec::MinMaxUInt8 => codec::decompress_accumulate(dtype, src, acc, first),
            Codec::MinMaxUInt4 => codec4::decompress_accumulate(dtype, src, acc, first),
        }
    }

    fn accumulate_f64(self, src: &[u8], acc: &mut [f64], first: bool) -> Result<()> {
        match self {
            Codec::MinMaxUInt8 => codec::decompress_accumulate_f64(src, acc, first),
            Codec::MinMaxUInt4 => codec4::decompress_accumulate_f64(src, acc, first),
        }
    }
}

/// Scratch memory kept between calls (no page faults on the hot path).
#[derive(Default)]
pub struct Scratch {
    send: Vec<u64>,
    recv: Vec<u64>,
    gather_in: Vec<u64>,
    gather_out: Vec<u64>,
    tmp: Vec<u64>,
    acc32: Vec<f32>,
    acc64: Vec<f64>,
}

/// The first `len` bytes of `v`, grown (zeroed) to hold them.
pub(crate) fn grow(v: &mut Vec<u64>, len: usize) -> &mut [u8] {
    if v.len() < len.div_ceil(8) {
        *v = vec![0u64; len.div_ceil(8)];
    }
    &mut bytemuck::cast_slice_mut(v)[..len]
}

/// The quantization errors error feedback carries from one call to the
/// next, for one bucket: the sender's (the whole bucket) and the chunk
/// owner's (this rank's chunk), in the bucket's dtype.
#[derive(Default, Clone, Debug)]
pub struct Feedback {
    worker: Vec<u64>,
    server: Vec<u64>,
    /// (bucket bytes, chunk bytes, dtype) the residuals were sized for: a
    /// bucket that changed starts again from zero.
    shape: Option<(usize, usize, DType)>,
}

impl Feedback {
    fn fit(&mut self, bucket: usize, chunk: usize, dtype: DType) {
        if self.shape != Some((bucket, chunk, dtype)) {
            self.worker = vec![0u64; bucket.div_ceil(8)];
            self.server = vec![0u64; chunk.div_ceil(8)];
            self.shape = Some((bucket, chunk, dtype));
        }
    }

    /// The sender's residual (the bucket's bytes) and the owner's residual
    /// (this rank's chunk's bytes); empty before the first call.
    pub fn residuals(&self) -> (&[u8], &[u8]) {
        match self.shape {
            Some((b, c, _)) => (
                &bytemuck::cast_slice(&self.worker)[..b],
                &bytemuck::cast_slice(&self.server)[..c],
            ),
            None => (&[], &[]),
        }
    }
}

/// Compresses `x` (one chunk) into `out`; with a residual, adds it to `x`
/// first and leaves in it what the compression lost (`x - Q(x)`).
fn compress_with(
    codec: Codec,
    dtype: DType,
    x: &mut [u8],
    out: &mut [u8],
    residual: Option<&mut [u8]>,
    tmp: &mut Vec<u64>,
) -> Result<()> {
    match residual {
        None => codec.compress(dtype, x, out),
        Some(r) => {
            arith::add(x, r, dtype)?;
            codec.compress(dtype, x, out)?;
            let back = grow(tmp, x.len());
            codec.decompress(dtype, out, back)?;
            arith::sub_into(r, x, back, dtype)
        }
    }
}

/// Sums (or averages) `buf` over `comm`'s ranks through MinMaxUInt8
/// compression, as described in the module documentation. Every rank ends
/// with the same bits.
pub(crate) fn compressed_all_reduce(
    comm: &mut Communicator,
    buf: &mut [u8],
    dtype: DType,
    average: bool,
    codec: Codec,
    mut feedback: Option<&mut Feedback>,
    s: &mut Scratch,
) -> Result<()> {
    arith::require_float(dtype, &format!("{} compression", codec.name()))?;
    let esz = dtype.size();
    if !buf.len().is_multiple_of(esz) {
        return Err(Error::InvalidArgument(format!(
            "compressed all_reduce: {} bytes is not a whole number of {} elements",
            buf.len(),
            dtype.name()
        )));
    }
    let (p, me, n) = (comm.size(), comm.rank(), buf.len() / esz);
    let mine = chunk(n, p, me);
    let clen = |r: Range<usize>| codec.compressed_len(dtype, r.len());
    if let Some(fb) = feedback.as_deref_mut() {
        fb.fit(buf.len(), mine.len() * esz, dtype);
    }

    // 1. Scatter: chunk j, compressed, to rank j.
    let send_counts: Vec<usize> = (0..p).map(|j| clen(chunk(n, p, j))).collect();
    let send_total: usize = send_counts.iter().sum();
    let send = grow(&mut s.send, send_total);
    let mut at = 0;
    for (j, &len) in send_counts.iter().enumerate() {
        let r = chunk(n, p, j);
        let bytes = r.start * esz..r.end * esz;
        let residual = match feedback.as_deref_mut() {
            Some(fb) => {
                Some(&mut bytemuck::cast_slice_mut::<u64, u8>(&mut fb.worker)[bytes.clone()])
            }
            None => None,
        };
        compress_with(
            codec,
            dtype,
            &mut buf[bytes],
            &mut send[at..at + len],
            residual,
            &mut s.tmp,
        )?;
        at += len;
    }
    let block = clen(mine.clone());
    let recv_counts = vec![block; p];
    let recv = grow(&mut s.recv, block * p);
    comm.all_to_all_v(send, &send_counts, recv, &recv_counts, DType::U8)?;

    // 2. Reduce this rank's chunk: the p versions, in rank order.
    let out = &mut buf[mine.start * esz..mine.end * esz];
    let divisor = if average { p as f64 } else { 1.0 };
    if dtype == DType::F64 {
        s.acc64.resize(mine.len(), 0.0);
        for (i, b) in recv.chunks_exact(block).take(p).enumerate() {
            codec.accumulate_f64(b, &mut s.acc64, i == 0)?;
        }
        codec::store_scaled_f64(&s.acc64, divisor, out)?;
    } else {
        s.acc32.resize(mine.len(), 0.0);
        for (i, b) in recv.chunks_exact(block).take(p).enumerate() {
            codec.accumulate(dtype, b, &mut s.acc32, i == 0)?;
        }
        codec::store_scaled(dtype, &s.acc32, divisor as f32, out)?;
    }

    // 3. Gather: every rank's reduced chunk, compressed, padded to the
    //    longest chunk's block.
    let widest = clen(chunk(n, p, 0)).max(clen(chunk(n, p, p - 1)));
    let gin = grow(&mut s.gather_in, widest);
    let residual = match feedback {
        Some(fb) => Some(&mut bytemuck::cast_slice_mut::<u64, u8>(&mut fb.server)[..out.len()]),
        None => None,
    };
    compress_with(codec, dtype, out, &mut gin[..block], residual, &mut s.tmp)?;
    let gout = grow(&mut s.gather_out, widest * p);
    comm.all_gather(gin, gout, DType::U8)?;
    for j in 0..p {
        let r = chunk(n, p, j);
        let len = clen(r.clone());
        codec.decompress(
            dtype,
            &gout[j * widest..j * widest + len],
            &mut buf[r.start * esz..r.end * esz],
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_cover_and_match_bagua_when_divisible() {
        for (n, p) in [(12usize, 4usize), (10, 3), (0, 2), (3, 5), (1, 1)] {
            let mut next = 0;
            for j in 0..p {
                let r = chunk(n, p, j);
                assert_eq!(r.start, next);
                next = r.end;
                if n % p == 0 {
                    assert_eq!(r.len(), n / p);
                }
            }
            assert_eq!(next, n);
        }
    }
}

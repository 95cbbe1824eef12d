//! Buckets: runs of registered tensors of one dtype and device that are
//! communicated together, and the layout of a flattened bucket.

use super::TensorMeta;
use crate::dtype::DType;
use crate::error::{Error, Result};

/// One bucket: indices into the module's tensors, in communication order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    /// Tensor indices (registration numbers) in the bucket's order.
    pub tensors: Vec<usize>,
    /// The element type every tensor of the bucket has.
    pub dtype: DType,
    /// The device every tensor of the bucket lives on.
    pub device: String,
}

/// Where each tensor of a flattened bucket starts in the bucket's buffer.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BucketLayout {
    /// Element offset of each tensor, in bucket order (tensors are packed back
    /// to back).
    pub offsets: Vec<usize>,
    /// Elements holding data (the sum of the tensors' sizes).
    pub data_elems: usize,
    /// Elements of zero padding after the data so that the buffer size is a
    /// multiple of the alignment.
    pub padding_elems: usize,
}

impl BucketLayout {
    /// Elements in the whole buffer, padding included.
    pub fn total_elems(&self) -> usize {
        self.data_elems + self.padding_elems
    }
}

impl Bucket {
    /// Builds a bucket from tensors that must share one dtype and device.
    pub(crate) fn new(members: &[&TensorMeta], ids: Vec<usize>) -> Result<Bucket> {
        let first = members
            .first()
            .ok_or_else(|| Error::InvalidArgument("a bucket needs at least one tensor".into()))?;
        for m in members {
            if m.dtype != first.dtype || m.device != first.device {
                return Err(Error::InvalidArgument(format!(
                    "bucket mixes tensor '{}' ({} on {}) with tensor '{}' ({} on {}): \
                     a bucket holds one dtype on one device",
                    first.name,
                    first.dtype.name(),
                    first.device,
                    m.name,
                    m.dtype.name(),
                    m.device
                )));
            }
        }
        Ok(Bucket {
            tensors: ids,
            dtype: first.dtype,
            device: first.device.clone(),
        })
    }

    /// Offsets of the tensors in a flattened buffer whose size is padded to a
    /// multiple of `alignment` elements (`alignment` 0 or 1: no padding).
    pub fn layout(&self, counts: &[usize], alignment: usize) -> BucketLayout {
        let mut offsets = Vec::with_capacity(counts.len());
        let mut at = 0;
        for c in counts {
            offsets.push(at);
            at += c;
        }
        let align = alignment.max(1);
        BucketLayout {
            offsets,
            data_elems: at,
            padding_elems: at.next_multiple_of(align) - at,
        }
    }
}

/// Cuts `tensors` (in the given order) into groups of at most `cap_bytes`
/// bytes each, starting a new group whenever the dtype or device changes. A
/// tensor larger than the cap gets a group of its own. Returns positions in
/// `tensors`.
pub fn plan_buckets(tensors: &[&TensorMeta], cap_bytes: usize) -> Vec<Vec<usize>> {
    let mut out: Vec<Vec<usize>> = Vec::new();
    let mut bytes = 0usize;
    let mut key: Option<(DType, &str)> = None;
    for (i, t) in tensors.iter().enumerate() {
        let k = (t.dtype, t.device.as_str());
        let fits = bytes + t.nbytes() <= cap_bytes;
        match out.last_mut() {
            Some(group) if key == Some(k) && fits => {
                group.push(i);
                bytes += t.nbytes();
            }
            _ => {
                out.push(vec![i]);
                bytes = t.nbytes();
                key = Some(k);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta(name: &str, count: usize, dtype: DType, device: &str) -> TensorMeta {
        TensorMeta {
            name: name.into(),
            count,
            dtype,
            device: device.into(),
        }
    }

    #[test]
    fn plan_cuts_by_cap_and_kind() {
        let t = [
            meta("a", 4, DType::F32, "cpu"),    // 16 B
            meta("b", 4, DType::F32, "cpu"),    // 16 B -> 32 fits
            meta("c", 2, DType::F32, "cpu"),    // 8 B -> 40 > 32: new
            meta("d", 100, DType::F32, "cpu"),  // over the cap: alone
            meta("e", 1, DType::F64, "cpu"),    // dtype change
            meta("f", 1, DType::F64, "cuda:0"), // device change
            meta("g", 1, DType::F64, "cuda:0"),
        ];
        let refs: Vec<&TensorMeta> = t.iter().collect();
        assert_eq!(
            plan_buckets(&refs, 32),
            vec![vec![0, 1], vec![2], vec![3], vec![4], vec![5, 6]]
        );
        assert!(plan_buckets(&[], 32).is_empty());
    }

    #[test]
    fn bucket_rejects_mixes() {
        let a = meta("a", 1, DType::F32, "cpu");
        let b = meta("b", 1, DType::F16, "cpu");
        let c = meta("c", 1, DType::F32, "cuda:0");
        let e = Bucket::new(&[&a, &b], vec![0, 1]).unwrap_err();
        assert!(e.to_string().contains("one dtype on one device"), "{e}");
        assert!(Bucket::new(&[&a, &c], vec![0, 2]).is_err());
        assert!(Bucket::new(&[], vec![]).is_err());
        assert!(Bucket::new(&[&a, &a], vec![0, 0]).is_ok());
    }

    #[test]
    fn layout_packs_and_pads() {
        let a = meta("a", 1, DType::F32, "cpu");
        let b = Bucket::new(&[&a, &a, &a], vec![0, 1, 2]).unwrap();
        let l = b.layout(&[3, 5, 1], 4);
        assert_eq!(l.offsets, vec![0, 3, 8]);
        assert_eq!((l.data_elems, l.padding_elems, l.total_elems()), (9, 3, 12));
        assert_eq!(b.layout(&[3, 5], 1).padding_elems, 0);
        assert_eq!(b.layout(&[4, 4], 4).padding_elems, 0);
        assert_eq!(b.layout(&[], 0).total_elems(), 0);
    }
}

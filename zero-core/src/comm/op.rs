//! What a rank says about the collective it is entering, so that peers can check they agree.

use super::{CommError, DType, FlatBuffer, ReduceOp, Subject};

/// The collectives, by name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum OpKind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Barrier,
}

impl OpKind {
    /// The name used in errors (the method's name).
    pub(crate) fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Barrier => "barrier",
        }
    }

    fn code(self) -> u8 {
        self as u8
    }

    fn from_code(code: u8) -> Option<Self> {
        [
            OpKind::AllReduce,
            OpKind::ReduceScatter,
            OpKind::AllGather,
            OpKind::Broadcast,
            OpKind::Barrier,
        ]
        .into_iter()
        .find(|k| k.code() == code)
    }
}

/// One rank's description of a collective: every rank must post an equal one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct OpDesc {
    pub kind: OpKind,
    pub seq: u64,
    pub dtype: DType,
    pub len: u64,
    pub reduce: Option<ReduceOp>,
    pub root: u64,
    /// What the caller said it moves.
    pub subject: Subject,
}

/// Size of [`OpDesc::encode`]'s output.
pub(crate) const DESC_BYTES: usize = 40;
const MAGIC: u32 = 0x5a45_524f; // "ZERO"

impl OpDesc {
    /// The buffer part, as errors show it.
    pub(crate) fn detail(&self) -> String {
        let mut s = format!("{} {:?} elements", self.len, self.dtype);
        if let Some(op) = self.reduce {
            s.push_str(&format!(" with {op:?}"));
        }
        if self.kind == OpKind::Broadcast {
            s.push_str(&format!(" from root {}", self.root));
        }
        s
    }

    /// Compares this rank's (`rank`) description with `peer`'s; the error names both.
    pub(crate) fn check(&self, rank: usize, peer: usize, theirs: &OpDesc) -> Result<(), CommError> {
        if self.kind == theirs.kind && self.seq == theirs.seq && self.subject != theirs.subject {
            return Err(CommError::SubjectMismatch {
                seq: self.seq,
                op: self.kind.name().to_string(),
                rank,
                subject: self.subject.to_string(),
                peer,
                peer_subject: theirs.subject.to_string(),
            });
        }
        if self.kind != theirs.kind || self.seq != theirs.seq {
            let peer_op = if self.seq == theirs.seq {
                theirs.kind.name().to_string()
            } else {
                format!("{} (its #{})", theirs.kind.name(), theirs.seq)
            };
            return Err(CommError::Mismatch {
                seq: self.seq,
                rank,
                op: self.kind.name().to_string(),
                peer,
                peer_op,
            });
        }
        if self != theirs {
            return Err(CommError::ShapeMismatch {
                seq: self.seq,
                op: self.kind.name().to_string(),
                rank,
                detail: self.detail(),
                peer,
                peer_detail: theirs.detail(),
            });
        }
        Ok(())
    }

    /// The wire form (little endian): magic, kind, dtype, reduce op, seq, len, root, subject.
    pub(crate) fn encode(&self) -> [u8; DESC_BYTES] {
        let mut b = [0u8; DESC_BYTES];
        b[0..4].copy_from_slice(&MAGIC.to_le_bytes());
        b[4] = self.kind.code();
        b[5] = match self.dtype {
            DType::F32 => 0,
            DType::F16 => 1,
            DType::BF16 => 2,
        };
        b[6] = match self.reduce {
            None => 0,
            Some(ReduceOp::Sum) => 1,
            Some(ReduceOp::Avg) => 2,
            Some(ReduceOp::Max) => 3,
        };
        b[8..16].copy_from_slice(&self.seq.to_le_bytes());
        b[16..24].copy_from_slice(&self.len.to_le_bytes());
        b[24..32].copy_from_slice(&self.root.to_le_bytes());
        b[32..40].copy_from_slice(&self.subject.code().to_le_bytes());
        b
    }

    /// Parses [`OpDesc::encode`]'s output; `None` if it is not one (a stream out of step).
    pub(crate) fn decode(b: &[u8; DESC_BYTES]) -> Option<Self> {
        let word = |r: std::ops::Range<usize>| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[r]);
            u64::from_le_bytes(a)
        };
        if u32::from_le_bytes([b[0], b[1], b[2], b[3]]) != MAGIC {
            return None;
        }
        let dtype = match b[5] {
            0 => DType::F32,
            1 => DType::F16,
            2 => DType::BF16,
            _ => return None,
        };
        let reduce = match b[6] {
            0 => None,
            1 => Some(ReduceOp::Sum),
            2 => Some(ReduceOp::Avg),
            3 => Some(ReduceOp::Max),
            _ => return None,
        };
        Some(OpDesc {
            kind: OpKind::from_code(b[4])?,
            seq: word(8..16),
            dtype,
            len: word(16..24),
            reduce,
            root: word(24..32),
            subject: Subject::from_code(word(32..40))?,
        })
    }
}

/// Checks what no rank could make valid: a reduce-scatter input the world size does not divide,
/// a broadcast root outside the group, an output buffer of the wrong dtype or length.
// `%` rather than `is_multiple_of`: the workspace supports Rust 1.85.
#[allow(clippy::manual_is_multiple_of)]
pub(crate) fn validate(
    kind: OpKind,
    buffer: &FlatBuffer,
    world: usize,
    root: usize,
    out: Option<&FlatBuffer>,
) -> Result<(), CommError> {
    let invalid = |message: String| {
        Err(CommError::InvalidArgument {
            op: kind.name().to_string(),
            message,
        })
    };
    let len = buffer.len();
    if kind == OpKind::ReduceScatter && len % world != 0 {
        return invalid(format!(
            "input length {len} is not a multiple of the world size {world}"
        ));
    }
    if kind == OpKind::Broadcast && root >= world {
        return invalid(format!("root {root} is not a rank of a group of {world}"));
    }
    if let Some(out) = out {
        let (want, what) = match kind {
            OpKind::ReduceScatter => (len / world, format!("a chunk of {len} elements over {world} ranks")),
            _ => (len * world, format!("gathering {len} elements from {world} ranks")),
        };
        if out.dtype() != buffer.dtype() || out.len() != want {
            return invalid(format!(
                "the output holds {} {:?} elements; {what} needs {want} {:?} elements",
                out.len(),
                out.dtype(),
                buffer.dtype()
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_mismatch() {
        let d = OpDesc {
            kind: OpKind::Broadcast,
            seq: 7,
            dtype: DType::BF16,
            len: 1001,
            reduce: None,
            root: 3,
            subject: Subject::Unit(4),
        };
        assert_eq!(OpDesc::decode(&d.encode()), Some(d));
        // Another unit at the same place fails naming both units, whatever the lengths.
        let other_unit = OpDesc {
            subject: Subject::Unit(5),
            len: 1000,
            ..d
        };
        let msg = d.check(0, 1, &other_unit).unwrap_err().to_string();
        assert!(
            msg.contains("unit 4") && msg.contains("unit 5") && msg.contains("rank 1"),
            "{msg}"
        );
        let other = OpDesc { len: 1000, ..d };
        let msg = d.check(0, 2, &other).unwrap_err().to_string();
        assert!(
            msg.contains("#7") && msg.contains("rank 2") && msg.contains("1000"),
            "{msg}"
        );
        let gather = OpDesc {
            kind: OpKind::AllGather,
            ..d
        };
        assert!(matches!(
            d.check(0, 1, &gather),
            Err(CommError::Mismatch { seq: 7, peer: 1, .. })
        ));
    }
}

//! What a parameter server or a trainer saves on a reclaim notice (or SIGTERM) and reads back
//! when it starts again: a few `key=value` lines, the weights as the bits of each f64 so a
//! resumed model is exactly the saved one.

/// One process's state: a PS saves its step count and its shard of the weights, a trainer the
/// step it reached and the offset of the next sample of its data stream.
#[derive(Debug, Clone, PartialEq)]
pub struct Checkpoint {
    pub step: u64,
    pub offset: u64,
    pub weights: Vec<f64>,
}

const MAGIC: &str = "tp-checkpoint 1";

pub fn encode(c: &Checkpoint) -> String {
    let w: Vec<String> = c.weights.iter().map(|w| format!("{:016x}", w.to_bits())).collect();
    format!("{MAGIC}\nstep={}\noffset={}\nweights={}\n", c.step, c.offset, w.join(","))
}

pub fn decode(text: &str) -> Result<Checkpoint, String> {
    let mut lines = text.lines();
    if lines.next() != Some(MAGIC) {
        return Err(format!("not a checkpoint (first line is not {MAGIC:?})"));
    }
    let (mut step, mut offset, mut weights) = (None, None, None);
    for line in lines {
        let (key, value) = line.split_once('=').ok_or_else(|| format!("bad line {line:?}"))?;
        match key {
            "step" => step = Some(value.parse::<u64>().map_err(|e| format!("step {value:?}: {e}"))?),
            "offset" => offset = Some(value.parse::<u64>().map_err(|e| format!("offset {value:?}: {e}"))?),
            "weights" => weights = Some(decode_weights(value)?),
            _ => {} // written by a later version: ignored
        }
    }
    Ok(Checkpoint {
        step: step.ok_or("no step")?,
        offset: offset.ok_or("no offset")?,
        weights: weights.ok_or("no weights")?,
    })
}

fn decode_weights(value: &str) -> Result<Vec<f64>, String> {
    if value.is_empty() {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .map(|h| u64::from_str_radix(h, 16).map(f64::from_bits).map_err(|e| format!("weight {h:?}: {e}")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_checkpoint_comes_back_bit_for_bit() {
        let c = Checkpoint { step: 1234, offset: 98_304, weights: vec![0.1, -2.5e-300, f64::MAX, -0.0, 1.0 / 3.0] };
        let back = decode(&encode(&c)).unwrap();
        assert_eq!(back.step, 1234);
        assert_eq!(back.offset, 98_304);
        let bits = |w: &[f64]| w.iter().map(|w| w.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&back.weights), bits(&c.weights));
        let empty = Checkpoint { step: 0, offset: 7, weights: vec![] };
        assert_eq!(decode(&encode(&empty)).unwrap(), empty);
    }

    #[test]
    fn garbage_is_an_error_not_a_fresh_start() {
        assert!(decode("").is_err());
        assert!(decode("<Error><Code>NoSuchKey</Code></Error>").is_err());
        assert!(decode("tp-checkpoint 1\nstep=x\noffset=0\nweights=\n").is_err());
        assert!(decode("tp-checkpoint 1\nstep=1\nweights=\n").unwrap_err().contains("offset"));
        assert!(decode("tp-checkpoint 1\nstep=1\noffset=0\nweights=zz\n").is_err());
    }
}

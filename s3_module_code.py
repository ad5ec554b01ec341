# A birth inside library module code (not a hook): usage s3_module_code.py CASE
#   llama_rmsnorm: LlamaRMSNorm eps=0 on an all-zero row -> rsqrt(0)=inf, 0*inf=nan (fp32)
#   t5_fp16: T5 DenseReluDense.wi weights scaled x500 (and the FF layer_norm x500) -> fp16 overflow in wi's mm
import os, sys; os.environ["HF_HUB_OFFLINE"] = "1"
import torch
sys.path.insert(0, "/tmp/newuser_repro"); from common import *
import transformers as T
case = sys.argv[1]; level = sys.argv[2] if len(sys.argv) > 2 else "minimal"
torch.manual_seed(0)
d = fresh(f"s3_{case}_{level}")
if case == "llama_rmsnorm":
    model = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, intermediate_size=64, vocab_size=100, max_position_embeddings=64, rms_norm_eps=0.0))
    prec = "fp32"
else:
    model = T.T5ForConditionalGeneration(T.T5Config(d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=16, vocab_size=100, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    prec = "fp16"
opt = torch.optim.SGD(model.parameters(), lr=1e-3)
g = make_guard(model, opt, d, level=level, precision=prec)
ids = torch.randint(1, 100, (2, 8))
faults = {}
for step in range(7):
    if step == 4:
        with torch.no_grad():
            if case == "llama_rmsnorm":
                model.model.embed_tokens.weight[ids[0, 3]] = 0.0   # a zero row
            else:
                ff = model.encoder.block[1].layer[1]
                ff.DenseReluDense.wi.weight.mul_(500.0); ff.layer_norm.weight.mul_(500.0)
                print("max |wi|", ff.DenseReluDense.wi.weight.abs().max().item())
    r = g.step(lambda: model(input_ids=ids, labels=ids).loss)
    print(r.step, r.action, r.reason, round(r.loss, 4), r.scale)
    if r.action != "applied": print(fault_str(r)); faults[r.step] = r.fault
g.close()
check(d, faults)

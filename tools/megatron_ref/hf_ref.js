// Reference ids from the Hugging Face `tokenizers` library (Rust) through its node binding
// (npm: @anush008/tokenizers-linux-x64-gnu, tokenizers 0.22):
//   node tools/megatron_ref/hf_ref.js BINDING.node tokenizer.json texts.json out.json
// Writes {"tokenizers": "<binding>", "cases": [{"text", "ids" (add_special_tokens=true),
// "ids_no_special"}]}.
const fs = require('fs');
const [binding, tokPath, textsPath, outPath] = process.argv.slice(2);
const {Tokenizer} = require(require('path').resolve(binding));
(async () => {
  const tok = Tokenizer.fromFile(tokPath);
  const texts = JSON.parse(fs.readFileSync(textsPath, 'utf8'));
  const cases = [];
  for (const text of texts) {
    const a = await tok.encode(text, null, {addSpecialTokens: true});
    const b = await tok.encode(text, null, {addSpecialTokens: false});
    cases.push({text, ids: Array.from(a.getIds()), ids_no_special: Array.from(b.getIds())});
  }
  fs.writeFileSync(outPath, JSON.stringify({tokenizers: binding, tokenizer: require('path').basename(tokPath), cases}));
  console.log(`wrote ${outPath}: ${cases.length} cases`);
})();

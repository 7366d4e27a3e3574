// The official `@google/genai` npm client against `keel gateway`'s Gemini-format front
// (/v1beta/models/{m}:generateContent, :streamGenerateContent?alt=sse, :countTokens) through
// every upstream format. A gateway without that front fails here (404), it is not skipped.
// Run by run.sh.
import { GoogleGenAI, Type } from '@google/genai';
import { env, models, upstreamModels, REPLY, check, finish, assert } from './lib.mjs';

const ai = new GoogleGenAI({ apiKey: env.key, httpOptions: { baseUrl: env.gateway } });

// The HTTP status of a failed call: ApiError.status (@google/genai 2.x) or, in 1.x, the
// ClientError/ServerError message "got status: 404 Not Found. {...}".
function statusOf(e) {
  if (typeof e?.status === 'number') return e.status;
  const m = /got status: (\d+)/.exec(String(e?.message));
  return m ? Number(m[1]) : undefined;
}
async function rejectsWithStatus(promise, status) {
  let error;
  try {
    await promise;
  } catch (e) {
    error = e;
  }
  assert.ok(error, `expected HTTP ${status}, but the call succeeded`);
  assert.equal(statusOf(error), status, String(error.message).slice(0, 300));
  return error;
}

await check('the Gemini front is served (not a 404)', async () => {
  const res = await fetch(`${env.gateway}/v1beta/models/${models.gemini}:generateContent`, {
    method: 'POST', headers: { 'x-goog-api-key': env.key, 'content-type': 'application/json' },
    body: JSON.stringify({ contents: [{ role: 'user', parts: [{ text: 'say hello' }] }] }),
  });
  const body = await res.text();
  assert.notEqual(res.status, 404, `the gateway has no Gemini front: ${body}`);
  assert.equal(res.status, 200, body);
});

for (const model of upstreamModels) {
  await check(`models.generateContent via ${model}`, async () => {
    const r = await ai.models.generateContent({ model, contents: 'say hello', config: { systemInstruction: 'be brief' } });
    assert.equal(r.text, REPLY);
    assert.equal(r.candidates[0].finishReason, 'STOP');
    assert.equal(r.candidates[0].content.role, 'model');
    assert.ok(r.usageMetadata.promptTokenCount > 0 && r.usageMetadata.candidatesTokenCount > 0, JSON.stringify(r.usageMetadata));
  });

  await check(`models.generateContentStream via ${model}`, async () => {
    let text = '';
    let chunks = 0;
    let finishReason;
    for await (const chunk of await ai.models.generateContentStream({ model, contents: 'say hello' })) {
      chunks += 1;
      text += chunk.text ?? '';
      finishReason = chunk.candidates?.[0]?.finishReason ?? finishReason;
    }
    assert.equal(text, REPLY);
    assert.equal(finishReason, 'STOP');
    assert.ok(chunks > 3, `only ${chunks} chunks: not streamed`);
  });
}

// U+2028 / U+2029 are line ends to JavaScript: the SDK's SSE framing regex stops at them, so a
// gateway that writes them raw loses the rest of the stream ("Incomplete JSON segment").
for (const model of upstreamModels) {
  await check(`generateContentStream carries U+2028/U+2029 via ${model}`, async () => {
    let text = '';
    for await (const chunk of await ai.models.generateContentStream({ model, contents: 'one\u2028two\u2029three' })) {
      text += chunk.text ?? '';
    }
    assert.ok(text.startsWith('one\u2028two\u2029three'), JSON.stringify(text));
  });
}

await check('apiVersion v1: models.list and models.get', async () => {
  const v1 = new GoogleGenAI({ apiKey: env.key, apiVersion: 'v1', httpOptions: { baseUrl: env.gateway } });
  const names = [];
  for await (const m of await v1.models.list()) names.push(m.name);
  assert.ok(names.includes(`models/${models.gemini}`), JSON.stringify(names));
  const one = await v1.models.get({ model: models.gemini });
  assert.equal(one.name, `models/${models.gemini}`);
});

for (const model of [models.geminiTools, models.openaiTools, models.anthropicTools]) {
  await check(`function calling via ${model}`, async () => {
    const tools = [{ functionDeclarations: [{ name: 'find', description: 'finds', parameters: { type: Type.OBJECT, properties: { q: { type: Type.STRING } } } }] }];
    const r = await ai.models.generateContent({ model, contents: 'find x', config: { tools } });
    assert.equal(r.functionCalls?.length, 1, JSON.stringify(r.candidates));
    assert.equal(r.functionCalls[0].name, 'find');
    assert.deepEqual(r.functionCalls[0].args, { x: 1 });
  });
}

await check('generationConfig: maxOutputTokens, stopSequences', async () => {
  const cut = await ai.models.generateContent({ model: models.openai, contents: 'say hello', config: { maxOutputTokens: 3 } });
  assert.equal(cut.text, 'say hello w2');
  assert.equal(cut.candidates[0].finishReason, 'MAX_TOKENS');
  const stopped = await ai.models.generateContent({ model: models.anthropic, contents: 'say hello', config: { stopSequences: ['w3'] } });
  assert.equal(stopped.text, 'say hello w2 ');
  assert.equal(stopped.candidates[0].finishReason, 'STOP');
});

for (const model of upstreamModels) {
  await check(`responseMimeType application/json + responseSchema via ${model}`, async () => {
    const responseSchema = { type: Type.OBJECT, properties: { city: { type: Type.STRING }, days: { type: Type.INTEGER } }, required: ['city', 'days'] };
    const r = await ai.models.generateContent({ model, contents: 'say hello', config: { responseMimeType: 'application/json', responseSchema } });
    assert.deepEqual(JSON.parse(r.text), { city: 'say', days: 1 });
  });
}

await check('models.countTokens', async () => {
  const r = await ai.models.countTokens({ model: models.gemini, contents: 'say hello to everyone here' });
  assert.ok(r.totalTokens > 0, JSON.stringify(r));
});

await check('errors: bad key, unknown model, bad request', async () => {
  const bad = new GoogleGenAI({ apiKey: 'sk-keel-not-a-key', httpOptions: { baseUrl: env.gateway } });
  const auth = await rejectsWithStatus(bad.models.generateContent({ model: models.gemini, contents: 'x' }), 401);
  assert.match(String(auth.message), /"status":\s*"UNAUTHENTICATED"/);
  const nf = await rejectsWithStatus(ai.models.generateContent({ model: 'no-such-model', contents: 'x' }), 404);
  assert.match(String(nf.message), /"status":\s*"NOT_FOUND"/);
  // Two candidates: the gateway answers one, so it refuses the request.
  const br = await rejectsWithStatus(ai.models.generateContent({ model: models.gemini, contents: 'x', config: { candidateCount: 2 } }), 400);
  assert.match(String(br.message), /"status":\s*"INVALID_ARGUMENT"/);
});

finish('gemini');

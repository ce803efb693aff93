// omnirt voice demo: one WebRTC call to POST /v1/realtime/calls (the OpenAI Realtime WebRTC flow).
// The microphone goes out as Opus, the agent's voice comes back on the remote track, and the Realtime
// events travel on the data channel "oai-events". No build step, no CDN. With keys on, the page never
// holds a key: GET /demo/config says how to get in, and each call starts with a short-lived client
// secret from POST /demo/client_secret (when the operator enabled it with --demo-key-id).
"use strict";

const $ = (id) => document.getElementById(id);
const LEVEL_HEARD = 0.01; // RMS above which agent audio counts as heard

// `window.demo` is the page's state; the browser test reads it too. `phase` is the call's:
// idle -> mic (asking for the microphone) -> calling (the offer is out) -> call (answered) -> idle.
// `userTurns`: the user's turns by item id, each with its transcript once the server sent it. `calls`: the
// tool calls the page ran, by call id; `toolRounds`: how many replies in a row were calls.
const demo = window.demo = { auth: "none", iceServers: [], phase: "idle", ended: null, pc: null, channel: null,
  mic: null, callUrl: null, audio: null, turns: [], byResponse: new Map(), userTurn: null, lastSpeechStop: null,
  userTurns: new Map(), calls: new Map(), toolRounds: 0, model: null, maxAgentLevel: 0, agentLevel: 0 };

// ---- the model, voices and access ------------------------------------------------------------------------

async function loadConfig() {
  const r = await fetch("/demo/config");
  const { model, voices, default: preferred, auth, ice_servers: iceServers } = await r.json();
  demo.auth = auth; // "none", "client_secret" (fetched per call) or "api_key" (the demo is not enabled)
  demo.iceServers = iceServers; // none unless the operator configured STUN/TURN (--webrtc-ice-servers)
  demo.model = model;
  $("model").textContent = model;
  $("voice").replaceChildren(...voices.map((v) => new Option(v, v, v === preferred, v === preferred)));
  showStatus();
}

async function authorization() {
  if (demo.auth === "none") return {};
  if (demo.auth === "api_key") throw new Error("this server needs an API key, and its demo is not enabled");
  const r = await fetch("/demo/client_secret", { method: "POST" });
  if (!r.ok) throw new Error((await r.json()).error?.message || `HTTP ${r.status}`);
  return { Authorization: `Bearer ${(await r.json()).value}` };
}

$("voice").addEventListener("change", () => {
  if (demo.channel?.readyState === "open") sendVoice();
});

function sendVoice() {
  send({ type: "session.update", session: { type: "realtime", audio: { output: { voice: $("voice").value } } } });
}

// At the start of a call: the voice, transcripts of what the user says (written by the model itself), the tools.
function sendSettings() {
  send({ type: "session.update", session: { type: "realtime", ...toolSettings(), audio: {
    input: { transcription: { model: demo.model } }, output: { voice: $("voice").value } } } });
}

// ---- demo tools: defined and run in the page ------------------------------------------------------------
// The server streams a call as a `function_call` item; the page runs it when the item is done and, once the
// response is done, sends each result (a `function_call_output` item) and asks for the reply (`response.create`).

const MAX_TOOL_ROUNDS = 3; // replies in a row that may be calls; the one after them may not (tool_choice "none")
const TOOLS = {
  get_time: {
    description: "The current date and time on the user's device, in its time zone or another one",
    parameters: { type: "object", additionalProperties: false, properties: { timezone: { type: "string",
      maxLength: 64, description: "an IANA time zone such as Europe/Paris; the device's own when absent" } } },
    run({ timezone }) {
      const zone = timezone || Intl.DateTimeFormat().resolvedOptions().timeZone, now = new Date();
      // an unknown zone throws a RangeError: the model gets it as the result's error
      const time = now.toLocaleString("en-GB", { timeZone: zone, dateStyle: "full", timeStyle: "long" });
      return { time, timezone: zone, iso: now.toISOString() };
    },
  },
  roll_dice: {
    description: "Roll dice: each roll and their total",
    parameters: { type: "object", additionalProperties: false, required: ["sides", "count"], properties: {
      sides: { type: "integer", minimum: 2, maximum: 100, description: "faces of each die" },
      count: { type: "integer", minimum: 1, maximum: 10, description: "how many dice" } } },
    run({ sides, count }) {
      const whole = (x, lo, hi) => Number.isInteger(x) && x >= lo && x <= hi;
      if (!whole(sides, 2, 100) || !whole(count, 1, 10)) throw new Error("sides: 2 to 100, count: 1 to 10");
      const rolls = Array.from(crypto.getRandomValues(new Uint32Array(count)), (x) => 1 + (x % sides));
      return { rolls, total: rolls.reduce((a, b) => a + b, 0) };
    },
  },
};

// `?tools=off` starts with the tools off, `?tool_choice=auto|required|NAME` picks the choice (a named tool
// forces a call to it: the tiny model's random weights rarely call one by themselves).
function readToolParams() {
  const params = new URLSearchParams(location.search);
  $("tools").checked = params.get("tools") !== "off";
  const choice = params.get("tool_choice") || "auto";
  $("tool-choice").value = choice;
  if ($("tool-choice").value !== choice) { $("tool-choice").value = "auto"; error(`unknown tool_choice ${choice}`); }
  $("tool-choice").disabled = !$("tools").checked;
}

function toolSettings() {
  if (!$("tools").checked) return { tools: [], tool_choice: "auto" };
  const choice = $("tool-choice").value;
  const tools = Object.entries(TOOLS).map(([name, { description, parameters }]) =>
    ({ type: "function", name, description, parameters }));
  return { tools, tool_choice: TOOLS[choice] ? { type: "function", name: choice } : choice };
}

for (const id of ["tools", "tool-choice"]) {
  $(id).addEventListener("change", () => {
    $("tool-choice").disabled = !$("tools").checked;
    send({ type: "session.update", session: { type: "realtime", ...toolSettings() } });
  });
}

// A call the model made: run now and shown with its result; sent back when its response is done.
function runTool(turn, item) {
  const call = { callId: item.call_id, name: item.name, arguments: item.arguments, sent: false, accepted: false,
    output: JSON.stringify(toolResult(item.name, item.arguments)), el: line("tool", "Tool", "") };
  const [what, result] = ["call", "result"].map((kind) => Object.assign(document.createElement("code"),
    { className: kind }));
  what.textContent = `${call.name}(${call.arguments})`;
  result.textContent = call.output;
  call.el.text.replaceChildren(what, " → ", result);
  turn.calls.push(call);
  demo.calls.set(call.callId, call);
}

function toolResult(name, args) {
  if (!TOOLS[name]) return { error: `no tool named ${name}` };
  try {
    return TOOLS[name].run(JSON.parse(args || "{}"));
  } catch (e) {
    return { error: e.message };
  }
}

// OpenAI's flow: every result as a function_call_output item, then one response.create for the reply. Not
// after a cancelled response: the user talked over it, and their new turn gets the answer.
function sendResults(turn, response) {
  if (!turn.calls.length) { demo.toolRounds = 0; return; }
  if (!turn.transcript) turn.el.li.remove(); // the reply was only calls: its tool lines stand for it
  if (response.status !== "completed") return;
  for (const call of turn.calls) {
    send({ type: "conversation.item.create", item: { type: "function_call_output", call_id: call.callId,
      output: call.output } });
    call.sent = true;
  }
  demo.toolRounds += 1;
  send({ type: "response.create", response: { tool_choice: demo.toolRounds < MAX_TOOL_ROUNDS ? "auto" : "none" } });
}

// ---- the call -----------------------------------------------------------------------------------------

$("talk").addEventListener("click", () => (demo.pc ? hangUp("You hung up.") : call().catch(fail)));
// a client secret cannot hang up (it only starts sessions): then closing the peer connection ends the call
window.addEventListener("pagehide", () => {
  if (demo.callUrl && demo.auth === "none") navigator.sendBeacon(demo.callUrl + "/hangup");
});

async function call() {
  $("talk").disabled = true;
  setPhase("mic");
  // media permission first: Chromium then offers real host addresses instead of mDNS names
  demo.mic = await navigator.mediaDevices.getUserMedia({ audio: { echoCancellation: true, noiseSuppression: true } });
  const pc = demo.pc = new RTCPeerConnection({ iceServers: demo.iceServers }); // none by default: no network asked
  pc.addTrack(demo.mic.getAudioTracks()[0], demo.mic);
  pc.ontrack = (e) => playAgent(e.streams[0] || new MediaStream([e.track]));
  pc.onconnectionstatechange = () => {
    if (demo.pc !== pc) return; // a call this page already ended
    if (["failed", "closed"].includes(pc.connectionState)) hangUp(`The connection ${pc.connectionState}.`);
    else showStatus();
  };
  const channel = demo.channel = pc.createDataChannel("oai-events");
  channel.onopen = () => { showStatus(); sendSettings(); };
  channel.onmessage = (m) => onEvent(JSON.parse(m.data));
  channel.onclose = () => { if (demo.pc === pc) hangUp("The server ended the call."); };
  meter(demo.mic, $("mic-level"));

  await pc.setLocalDescription(await pc.createOffer());
  await gathered(pc); // the server does not trickle: send every candidate in the offer
  setPhase("calling");
  const r = await fetch("/v1/realtime/calls", { method: "POST", body: pc.localDescription.sdp,
    headers: { "Content-Type": "application/sdp", ...(await authorization()) } });
  if (!r.ok) throw new Error((await r.json()).error?.message || `HTTP ${r.status}`);
  demo.callUrl = r.headers.get("Location");
  await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
  setPhase("call");
  $("talk").textContent = "Hang up";
  $("talk").classList.add("live");
  $("talk").disabled = false;
}

function gathered(pc) {
  if (pc.iceGatheringState === "complete") return Promise.resolve();
  return new Promise((done) => {
    pc.addEventListener("icegatheringstatechange", () => pc.iceGatheringState === "complete" && done());
    setTimeout(done, 3000);
  });
}

function hangUp(message) {
  const pc = demo.pc;
  demo.ended = message;
  if (demo.phase === "idle") return showStatus(); // nothing to end (e.g. the page could not load its config)
  demo.pc = null;
  // hang up first (keyless servers), then close: closing first would end the call before the hangup arrives
  const hangup = demo.callUrl && demo.auth === "none" && !["failed", "closed"].includes(pc?.connectionState)
    ? fetch(demo.callUrl + "/hangup", { method: "POST" }).catch(() => {}) : Promise.resolve();
  hangup.finally(() => pc?.close());
  demo.callUrl = null;
  demo.channel = null;
  demo.mic?.getTracks().forEach((t) => t.stop());
  $("talk").textContent = "Talk";
  $("talk").classList.remove("live");
  $("talk").disabled = false;
  setPhase("idle");
}

function fail(err) {
  hangUp(`Could not start: ${err.message || err}`);
  error(String(err.message || err));
}

function send(event) {
  if (demo.channel?.readyState === "open") demo.channel.send(JSON.stringify(event));
}

// ---- audio: playback and level meters ---------------------------------------------------------------

function playAgent(stream) {
  demo.audio = $("agent-audio");
  demo.audio.srcObject = stream; // Chromium feeds a remote stream to Web Audio only while an element plays it
  demo.audio.play().catch((e) => error(`Playback blocked: ${e.message}`));
  meter(stream, $("agent-level"), (level) => {
    demo.agentLevel = level;
    demo.maxAgentLevel = Math.max(demo.maxAgentLevel, level);
    if (level > LEVEL_HEARD) heard();
  });
}

function meter(stream, bar, onLevel) {
  demo.ctx = demo.ctx || new AudioContext();
  demo.ctx.resume();
  const analyser = demo.ctx.createAnalyser();
  analyser.fftSize = 1024;
  demo.ctx.createMediaStreamSource(stream).connect(analyser);
  const samples = new Float32Array(analyser.fftSize);
  const timer = setInterval(() => {
    if (!stream.active) return clearInterval(timer);
    analyser.getFloatTimeDomainData(samples);
    const rms = Math.sqrt(samples.reduce((s, x) => s + x * x, 0) / samples.length);
    bar.style.width = `${Math.min(100, rms * 400)}%`;
    onLevel?.(rms);
  }, 40);
}

// ---- events ---------------------------------------------------------------------------------------------

function onEvent(ev) {
  const turn = demo.byResponse.get(ev.response_id || ev.response?.id);
  switch (ev.type) {
    case "input_audio_buffer.speech_started":
      demo.userTurn = line("user", "You", "(speaking…)");
      demo.userTurn.startMs = ev.audio_start_ms;
      demo.userTurn.transcript = null; // until the server's transcript comes
      demo.userTurns.set(ev.item_id, demo.userTurn);
      demo.toolRounds = 0;
      break;
    case "input_audio_buffer.speech_stopped": { // until its transcript comes: how long the user spoke
      demo.lastSpeechStop = performance.now();
      const user = demo.userTurns.get(ev.item_id) || demo.userTurn;
      if (user && user.transcript === null) {
        const seconds = (ev.audio_end_ms - user.startMs) / 1000;
        user.text.textContent = `(spoke for ${seconds.toFixed(1)} s)`;
      }
      break;
    }
    case "conversation.item.input_audio_transcription.delta": {
      const user = demo.userTurns.get(ev.item_id);
      if (user) { user.partial = (user.partial || "") + ev.delta; user.text.textContent = user.partial; }
      break;
    }
    case "conversation.item.input_audio_transcription.completed": {
      const user = demo.userTurns.get(ev.item_id);
      if (user) { user.transcript = ev.transcript; user.text.textContent = ev.transcript || "(nothing heard)"; }
      break;
    }
    case "conversation.item.input_audio_transcription.failed": {
      const user = demo.userTurns.get(ev.item_id);
      if (user) user.text.textContent += ` (no transcript: ${ev.error.message})`;
      break;
    }
    case "response.created":
      startTurn(ev.response.id);
      break;
    case "response.output_audio_transcript.delta":
    case "response.output_text.delta":
      if (turn) { turn.transcript += ev.delta; turn.el.text.textContent = turn.transcript; }
      break;
    case "output_audio_buffer.started":
      if (turn) turn.playing = true;
      break;
    case "output_audio_buffer.stopped":
      if (turn) {
        turn.playing = false;
        turn.audioMs = ev.omnirt_playback?.audio_ms;
        turn.underruns = ev.omnirt_playback?.num_underruns;
      }
      break;
    case "output_audio_buffer.cleared": // interrupted while playing (its generation may have ended already)
      if (turn) { turn.playing = false; turn.status = "interrupted"; turn.el.li.classList.add("cancelled"); }
      break;
    case "conversation.item.truncated": { // the server cut the item at what was played: show only that
      const t = demo.turns.find((x) => x.itemId === ev.item_id);
      if (t) t.audioMs = ev.audio_end_ms;
      send({ type: "conversation.item.retrieve", item_id: ev.item_id });
      break;
    }
    case "conversation.item.retrieved": {
      const t = demo.turns.find((x) => x.itemId === ev.item.id);
      const heard = ev.item.content.find((c) => c.transcript != null)?.transcript;
      if (t && heard != null) { t.heard = heard; t.el.text.textContent = heard; row(t); }
      break;
    }
    case "response.output_item.added":
      if (turn && ev.item.type === "message") turn.itemId = ev.item.id;
      break;
    case "response.output_item.done":
      if (turn && ev.item.type === "function_call" && ev.item.status === "completed") runTool(turn, ev.item);
      break;
    case "conversation.item.done": { // the server took a result the page sent
      const call = ev.item.type === "function_call_output" && demo.calls.get(ev.item.call_id);
      if (call) call.accepted = true;
      break;
    }
    case "response.done":
      if (turn) { finishTurn(turn, ev.response); sendResults(turn, ev.response); }
      break;
    case "error":
      error(`${ev.error.code || ev.error.type}: ${ev.error.message}`);
      break;
  }
  if (turn) row(turn);
}

function startTurn(responseId) {
  const turn = { n: demo.turns.length + 1, responseId, itemId: null, transcript: "", heard: null,
    createdAt: performance.now(),
    since: demo.lastSpeechStop ?? performance.now(), doneAt: null, heardAt: null, audioMs: null, underruns: null,
    status: "in progress", playing: false, calls: [], spoke: true, afterTools: demo.toolRounds > 0,
    el: line("agent", "Agent", "") };
  demo.lastSpeechStop = null;
  demo.turns.push(turn);
  demo.byResponse.set(responseId, turn);
}

function finishTurn(turn, response) {
  turn.doneAt = performance.now();
  if (turn.status !== "interrupted") turn.status = response.status;
  turn.spoke = response.output.some((o) => o.type === "message"); // a reply of calls only has no audio
  if (response.status === "cancelled") turn.el.li.classList.add("cancelled");
}

function heard() {
  const turn = demo.turns.findLast((t) => t.playing);
  if (turn && turn.heardAt === null) { turn.heardAt = performance.now(); row(turn); }
}

// ---- the page ---------------------------------------------------------------------------------------

function line(kind, who, text) {
  const li = document.createElement("li");
  li.className = kind;
  li.innerHTML = `<span class="who"></span><span class="text"></span>`;
  li.querySelector(".who").textContent = who;
  const el = { li, text: li.querySelector(".text") };
  el.text.textContent = text;
  $("transcript").append(li);
  li.scrollIntoView({ block: "end" });
  return el;
}

function row(turn) {
  turn.row = turn.row || $("metrics").tBodies[0].insertRow();
  const ms = (x) => (!turn.spoke ? "—" : x == null ? "…" : `${Math.round(x)} ms`);
  // only part of the audio was played (no RTF, no underrun count), or none was (a reply of tool calls only)
  const cut = turn.status === "interrupted" || !turn.spoke;
  const rtf = cut ? "—"
    : turn.doneAt && turn.audioMs ? ((turn.doneAt - turn.createdAt) / turn.audioMs).toFixed(2) : "…";
  const audio = !turn.spoke ? "—" : turn.audioMs == null ? "…" : `${(turn.audioMs / 1000).toFixed(1)} s`;
  const calls = turn.calls.length ? ` (${turn.calls.map((c) => c.name).join(", ")})` : "";
  const cells = [turn.n, ms(turn.heardAt && turn.heardAt - turn.since), rtf, audio, cut ? "—" : turn.underruns ?? "…",
    turn.status + calls];
  turn.row.replaceChildren(...cells.map((c) => Object.assign(document.createElement("td"), { textContent: c })));
}

// The status line follows from the call's phase and its connection's state, not from which event came last.
function setPhase(phase) { demo.phase = phase; showStatus(); }

function showStatus() {
  const pc = demo.pc, open = demo.channel?.readyState === "open";
  const idle = demo.auth === "api_key"
    ? "This server needs an API key; its operator can enable the demo (--demo-key-id)."
    : "Press Talk and allow the microphone. Speak; pause to let the agent answer; talk over it to interrupt.";
  const text = {
    idle: demo.ended ? `${demo.ended} ${idle}` : idle,
    mic: "Asking for the microphone…",
    calling: "Calling…",
    call: pc?.connectionState === "connected" && open ? "Connected: talk." : "Connecting…",
  }[demo.phase];
  $("status").textContent = text;
}

function error(text) { $("errors").textContent = text; }

readToolParams();
loadConfig().catch(fail);
